"""Regeneration's `hf` backend: batched chat generation with the target loaded locally (also what
data/openai_server.py serves)."""
from __future__ import annotations

from typing import Optional

from data.image_messages import conversation_images, has_images, template_messages
from data.regen_common import ROUND_TRIP, GenerationFailed, RegenerateError
from data.round_trip import last_segment, round_trip_len, round_trip_stop


class HFGenerator:
    """Batched chat generation with a loaded HF target: left-padded prompts rendered with the
    tokenizer's chat template (`add_generation_prompt=True`), stopping at the template's
    end-of-turn (`<|im_end|>` when the vocab has it) or the tokenizer's eos.

    `cut_at_round_trip`: an answer is kept (and generated) only as far as its text re-tokenizes to
    the generated tokens (data/round_trip.py), finish reason `round_trip` where it was cut; the
    stored text is then exactly the target's greedy tokens. `canonical_tokens`: a token whose text
    would not re-tokenize to itself is never picked (the next candidate is taken instead,
    data/round_trip.py `canonical_veto`), so such an answer goes on instead of being cut there."""

    def __init__(self, model, tokenizer, *, temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 256,
                 seed: int = 0, max_positions: Optional[int] = None, cut_at_round_trip: bool = False,
                 no_repeat_ngram_size: int = 0, sampled_opening_tokens: int = 0, canonical_tokens: bool = False):
        import torch

        self.model, self.tok = model, tokenizer
        self.cut_at_round_trip = cut_at_round_trip
        self.temperature, self.top_p, self.max_new_tokens, self.seed = temperature, top_p, max_new_tokens, seed
        self.max_positions = max_positions
        self.no_repeat_ngram_size, self.sampled_opening_tokens = no_repeat_ngram_size, sampled_opening_tokens
        self.canonical_tokens = canonical_tokens
        self.vetoed_tokens = 0  # picks the canonical-token veto refused, over every generate call (prepare's stats)
        stop = {tokenizer.eos_token_id}
        vocab = tokenizer.get_vocab()
        end_turn = vocab.get("<|im_end|>")
        self.end_think = vocab.get("</think>")  # thinking models: reasoning ends here
        stop.add(end_turn)
        self.stop_ids = sorted(i for i in stop if i is not None)
        if not self.stop_ids:
            raise RegenerateError("the tokenizer has neither an eos token nor <|im_end|>: generation could not stop")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self._device = next(model.parameters()).device
        self._torch = torch

    @classmethod
    def from_target(cls, target, tokenizer, regen_conf) -> "HFGenerator":
        from eagle3.target_model.target_io import load_target

        model, text_config = load_target(target.path, target.layout, dtype=target.dtype, device_map=target.device_map,
                                         trust_remote_code=target.trust_remote_code)
        return cls(model, tokenizer, temperature=regen_conf.temperature, top_p=regen_conf.top_p,
                   max_new_tokens=regen_conf.max_new_tokens, seed=regen_conf.seed,
                   max_positions=text_config.get("max_position_embeddings"),
                   cut_at_round_trip=regen_conf.cut_at_round_trip,
                   no_repeat_ngram_size=regen_conf.no_repeat_ngram_size,
                   sampled_opening_tokens=regen_conf.sampled_opening_tokens,
                   canonical_tokens=regen_conf.canonical_tokens)

    def generate(self, prompts: list[list[dict]], *, max_new_tokens: Optional[int] = None,
                 temperature: Optional[float] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None) -> list[tuple[str, str, Optional[str]]]:
        """(text, finish_reason "stop" | "length", reasoning or None) per message list."""
        torch = self._torch
        seeing = any(has_images(m) for m in prompts)
        max_new = max_new_tokens or self.max_new_tokens
        temp = self.temperature if temperature is None else temperature
        # a user turn's images become K2.5 image blocks in the text, as prepare renders them
        texts = [self.tok.apply_chat_template(template_messages(m) if seeing else m, tokenize=False,
                                              add_generation_prompt=True) for m in prompts]
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        longest = max(len(x) for x in ids)
        if self.max_positions and longest + max_new > self.max_positions:
            raise GenerationFailed(f"prompt of {longest} tokens + {max_new} new exceeds the target's "
                                   f"{self.max_positions} positions")
        batch = torch.full((len(ids), longest), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(batch)
        for i, x in enumerate(ids):  # left padding: every prompt ends at the last column
            batch[i, longest - len(x):] = torch.tensor(x)
            attn[i, longest - len(x):] = 1
        # greedy, or sampled with one generator per prompt (data/row_sampling.py): a conversation's answer
        # does not depend on the batch it was generated in
        kwargs = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=self.stop_ids, pad_token_id=self.pad_id)
        if self.no_repeat_ngram_size:  # over each row's prompt and answer (left pads never end a real n-gram)
            kwargs["no_repeat_ngram_size"] = self.no_repeat_ngram_size
        sampler = None
        if temp > 0 or self.canonical_tokens:
            from transformers import LogitsProcessorList

            from data.round_trip import canonical_veto
            from data.row_sampling import PerRowSampler, row_seed

            base = self.seed if seed is None else seed
            veto = canonical_veto(self.tok, longest, self.stop_ids, self.end_think) if self.canonical_tokens else None
            sampler = PerRowSampler(
                [row_seed(base, t) for t in texts], temp, self.top_p if top_p is None else top_p, self._device,
                opening=(longest, self.sampled_opening_tokens) if self.sampled_opening_tokens else None, veto=veto)
            kwargs["logits_processor"] = LogitsProcessorList([sampler])
        if self.cut_at_round_trip:
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [round_trip_stop(self.tok, longest, self.stop_ids, self.end_think)])
        if seeing:  # the target's multimodal forward: its projector's rows at the image ids (eagle3/target_model/target_images.py)
            kwargs["inputs_embeds"] = self._fused_embeddings(prompts, batch)
        with torch.no_grad():
            try:
                out = self.model.generate(input_ids=batch.to(self._device), attention_mask=attn.to(self._device),
                                          **kwargs)
            finally:  # a batch that fails and is redone row by row still refused those picks
                self.vetoed_tokens += sampler.vetoed if sampler is not None else 0
        results = []
        for row in out[:, longest:].tolist():
            stop_at = next((j for j, t in enumerate(row) if t in self.stop_ids), None)
            reason = "length" if stop_at is None else "stop"
            row = row if stop_at is None else row[:stop_at]
            if self.cut_at_round_trip:
                row, reason = self._cut_row(row, reason)
            reasoning, answer = split_reasoning(row, self.end_think)
            decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
            results.append((decode(answer), reason, decode(reasoning) if reasoning is not None else None))
        return results

    def _fused_embeddings(self, prompts: list[list[dict]], batch):
        """[B, T, H] input embeddings of the left-padded `batch` with every image's features at its
        `<|media_pad|>` rows (images in row-major order, as the prompts hold them). A target without a vision
        tower, or whose image_token_id is not the tokenizer's pad, fails the conversation."""
        from eagle3.media_tokens import MediaTokenError, image_token_id
        from eagle3.target_model.target_images import fused_input_embeddings, image_features, pixel_inputs
        from eagle3.target_model.target_io import TargetError

        try:
            pad_id = image_token_id(self.tok, self.model.config.to_dict())
            data, grids = [], []
            for m in prompts:
                d, g = conversation_images(m)
                data += d
                grids += [x for row in g for x in row]
            pixel_values, thw = pixel_inputs(data, grids)
            with self._torch.no_grad():
                feats = image_features(self.model, pixel_values, thw)
                return fused_input_embeddings(self.model, batch.to(self._device), pad_id, feats)
        except (MediaTokenError, TargetError) as e:
            raise GenerationFailed(f"image conversation: {e}") from e

    def _cut_row(self, row: list[int], reason: str) -> tuple[list[int], str]:
        """The row up to where its last segment (the answer, or the reasoning still open) stops
        surviving the round trip; rows stopped by `round_trip_stop` end in padding, dropped here."""
        if reason == "length":
            while row and row[-1] == self.pad_id:
                row = row[:-1]
        seg = last_segment(row, self.end_think)
        keep = round_trip_len(self.tok, seg)
        if keep == len(seg):
            return row, reason
        return row[: len(row) - len(seg) + keep], ROUND_TRIP


def split_reasoning(ids: list[int], end_think: Optional[int]) -> tuple[Optional[list[int]], list[int]]:
    """(reasoning ids or None, answer ids): a generation that closes a thinking block (the
    prompt of a thinking template ends with `<think>`) is split at its last `</think>`."""
    if end_think is None or end_think not in ids:
        return None, ids
    j = len(ids) - 1 - ids[::-1].index(end_think)
    return ids[:j], ids[j + 1:]
