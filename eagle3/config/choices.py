"""The values each config switch accepts: one home per choice list.

The typed config schemas (eagle3/config/schema/, which must import without torch) validate against these
lists, and the torch modules that act on a choice (the unroll, the attention kernels, the lm_head
remap, the target loader, the store reader, n-gram lookup, export) accept the same tuple, so a new
choice is added in one place. Standard library only: the core imports it on the GPU machine, which
has no hydra.
"""

FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # target, stored states, drafter during eval, exported weights
DEVICES = ("auto", "cpu", "cuda")                  # auto = cuda when available
SPLITS = ("train", "validation")                   # the prepare stage's splits, kept by every later stage
OVERLONG_POLICIES = ("truncate", "skip")           # a sequence longer than the limit: cut its tail | drop it
WANDB_MODES = ("offline", "online", "disabled")

# prepare
REGEN_BACKENDS = ("none", "hf", "openai")  # regenerate the assistant turns: no | local HF generate | a server

# capture
CAPTURE_BACKENDS = ("hf", "vllm")          # transformers forward with hooks | vLLM's extract_hidden_states
VLLM_ENGINES = ("server", "inprocess")     # a running `vllm serve` | vllm.LLM(...) in this process
AUX_FP8 = "float8_e4m3fn"                  # the one quantised aux format: fp8 codes + one fp32 scale per row
AUX_DTYPES = (AUX_FP8,)                    # besides null (= the store's dtype)

# the target and the init drafter
TARGET_LAYOUTS = ("kimi_k25", "causal_lm")            # K2.5's multimodal wrapper | a plain causal LM
INITS = ("aqmedai_k2", "scratch")                     # conf/init/: the K2 drafter | a fresh one
NEW_ROW_RULES = ("target_lm_head", "mean", "zeros")   # lm_head rows of tokens new to the draft vocab

# train
UNROLLS = ("auto", "fast", "reference")          # TTT unroll: auto = fast on CUDA
ATTENTION_KERNELS = ("auto", "flash", "cudnn")   # the fast unroll's causal attention
COMPILE_CHOICES = ("auto", "true", "false")      # torch.compile the fast unroll's memory-bound pieces
PRECISIONS = ("auto", "bf16", "no")              # auto = bf16 autocast on GPU, fp32 on CPU
NONFINITE_POLICIES = ("stop", "skip")            # a non-finite loss or gradient
STORE_VERIFY = ("size", "sha256", "none")        # hidden-state store check when opened / first read

# train and eval: what the drafter embeds at image rows (eagle3/drafter/image_embeddings.py; auto = the export engine's)
IMAGE_CONVENTIONS = ("fused", "placeholder")     # SGLang: the target's fused rows | vLLM: embed(<|media_pad|>)
IMAGE_EMBEDDINGS = ("auto", *IMAGE_CONVENTIONS)

# eval
NGRAM_PREFER = ("recent", "first")               # prompt lookup: newest match | first match (HF's)

# export
SERVE_ENGINES = ("sglang", "vllm")            # bench-serve: the engine behind a live server
EXPORT_FORMATS = ("sglang", "speculators")       # the directory layouts export writes
EXPORT_FORMAT_CHOICES = (*EXPORT_FORMATS, "both")
