"""The mini world's tokenizer: byte-level BPE trained on chat text, with Kimi-style special
tokens placed at the top of the id range (as Kimi's are: 163584+) and a Jinja chat template of
the same shape as Kimi-K2's, saved as a standard `tokenizer.json` + `tokenizer_config.json`
that `AutoTokenizer.from_pretrained` loads."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

BOS, EOS, UNK, PAD = "[BOS]", "[EOS]", "[UNK]", "[PAD]"
IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END = (
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
THINK, END_THINK = "<think>", "</think>"
# Order fixes their ids: the last len(SPECIAL_TOKENS) ids of the vocabulary.
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, THINK, END_THINK]
# Same shape as Kimi's template: `<|im_ROLE|>ROLE<|im_middle|>CONTENT<|im_end|>` per turn, content
# either a string or a list of {"type": "text"} parts, `add_generation_prompt` opening an assistant
# turn. No `{% generation %}` markers: the real Kimi template has none, so the loss mask must not
# depend on them. No default system turn (Kimi-K2's template adds one): a tiny LM trained on text
# where every conversation opens with the same system sentence learns to answer with it.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is none -%}"
    "{%- else -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>"
    "{%- endif -%}"
    "{{ render_content(message['content']) }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path | str, *, min_frequency: int = 2,
                    model_max_length: int = 4096):
    """Train a byte-level BPE of `vocab_size` ids in total (the learned merges fill the ids below
    the specials) on `texts`, save it to `out_dir` and return the loaded tokenizer.
    Deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_learned = vocab_size - len(SPECIAL_TOKENS)
    if n_learned < 256 + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small: the 256 byte tokens and "
                         f"{len(SPECIAL_TOKENS)} specials need at least {256 + 1 + len(SPECIAL_TOKENS)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_learned, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() < n_learned:
        # Too little text to learn all merges: pad with unused placeholder ids so the total (and
        # the specials' positions at the top) are what was asked for.
        base = tok.get_vocab_size()
        tok.add_tokens([f"<|unused_{i}|>" for i in range(n_learned - base)])
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        additional_special_tokens=[IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, THINK, END_THINK],
        model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    _ensure_template_in_config(out_dir)
    return fast


def _ensure_template_in_config(out_dir: Path) -> None:
    """transformers 5 may write the template to `chat_template.jinja`; the brief (and older
    loaders) want it inside `tokenizer_config.json` too."""
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("chat_template") != CHAT_TEMPLATE:
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def special_token_ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def add_media_tokens_to(out_dir: Path | str):
    """Give the saved tokenizer in `out_dir` Kimi-K2.5's four media tokens (eagle3/media_tokens.py; ids after
    its vocabulary, as K2's and K2.5's tokenizer share them: the text-only k2-mini simply never reads them),
    save it again and return it."""
    from transformers import AutoTokenizer

    from eagle3.media_tokens import add_media_tokens

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    add_media_tokens(tok)
    tok.save_pretrained(str(out_dir))
    _ensure_template_in_config(Path(out_dir))
    return tok
