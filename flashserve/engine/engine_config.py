"""``EngineConfig``: every engine option, declared once (the CLI derives its flags from these fields).

Torch-free, so that ``flashserve serve --help`` and a bad flag answer in a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass


INT8_KERNELS = ("auto", "aten", "chunked")  # EngineConfig.int8_kernel


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # folder holding tokenizer.json; None: the model's own
    dtype: str = "float32"
    device: str = "auto"  # "auto": CUDA when present, else CPU
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_memory: str | int = "1GiB"
    cache_dtype: str | None = None  # "packed" | "float"; None: packed for V4.1, float for V4
    exact_prefill: bool = False
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_waiting: int = 256
    seed: int = 0
    block_size: int = 64  # tokens per page (rounded up to a multiple of every compression ratio)
    prefill_chunk: int | None = None  # largest prefill chunk (default: max_num_batched_tokens)
    num_pages: int | None = None  # override the page count derived from kv_memory (tests)
    fake_quant: bool | None = None
    prefix_replay: str = "exact"  # prefix hit: "exact" rebuilds window state exactly; "window": the serving stacks' C−W rule
    threads: int | None = None  # torch intra-op threads, set at start-up (process-wide); None: engine/threads.py
    # Decode through a torch.compile'd fixed-shape step (False) or run that step eagerly (True). None: compiled; on
    # the CPU compiled in the background (below) by a child process while the eager step serves, each graph then
    # loaded here from what it saved (docs/engine-speed.md#compiled-in-the-background).
    enforce_eager: bool | None = None
    # Compile the decode step on a thread of its own while the engine serves with the eager step, switching to the
    # compiled step when it is done (True), or before serving (False). None: in the background on the CPU, before
    # serving on CUDA (where the CUDA graphs are recorded at start-up).
    background_compile: bool | None = None
    # A background compile's work done by a child process that builds the same engine and saves each graph it
    # compiles (True), leaving this process's interpreter to the serving thread: this process loads the graphs
    # without tracing (engine/graphs/step_artifacts.py); or on the compiling thread alone (False). None: a child where this engine loads its model itself (a model passed in
    # cannot be rebuilt there) and compiles with inductor (engine/graphs/compile_child.py).
    compile_child: bool | None = None
    # On CUDA the compiled step is recorded as a CUDA graph per input shape and replayed (the same compiled graph
    # as without them); False calls the compiled graph. Ignored on the CPU and with enforce_eager.
    cuda_graphs: bool = True
    compile_backend: str = "inductor"  # torch.compile backend of the decode step (tests also use dynamo's "eager")
    # Where inductor keeps what it compiled, reused by later starts (its TORCHINDUCTOR_CACHE_DIR, set process-wide
    # when given). None: $TORCHINDUCTOR_CACHE_DIR, else inductor's own folder under the system's temporary one.
    compile_cache: str | None = None
    # Weights in memory: None keeps a checkpoint as stored (FP8/MXFP4 stay packed), "int8" | "w8a8" | "fp8" |
    # "mxfp4" pack float weights at load, "float" unpacks (the reference), "w4a8" multiplies MXFP4 experts by
    # activations rounded to 8 bits (not exact); see flashserve.model.packed and loader.activations_in_8_bits.
    quantization: str | None = None
    # A checkpoint's safetensors files memory-mapped, the tensors held as stored used where they lie (llama.cpp's
    # default; False copies every tensor into memory, as its --no-mmap), and the weights locked in RAM (its
    # --mlock). See flashserve.model.loader.load_model.
    mmap: bool = True
    mlock: bool = False
    # Resident budget for the weights (a size such as "8GiB"; a checkpoint folder): the routed experts that do not
    # fit are read from the files when routed, through a cache of expert slots per layer evicting by
    # expert_cache_policy ("lru" | "lfu"); decode runs eagerly then. See flashserve.model.expert_cache.
    weight_memory: str | int | None = None
    expert_cache_policy: str = "lru"
    # On a GPU: each MoE layer holds this many routed experts there (the most used, rebalanced as traffic goes), the
    # others stay in host memory and run on the CPU kernels, as ktransformers does (llama.cpp's --n-cpu-moe keeps
    # whole layers' experts on the CPU); decode runs eagerly. None: every expert on the device. See
    # flashserve.model.hybrid.
    gpu_experts: int | None = None
    # Eager int8 products through torch's int8 kernel ("aten") or in float chunks ("chunked"); "auto" times both
    # on this CPU at start-up (flashserve.engine.execution). Process-wide.
    int8_kernel: str = "auto"
    # Speculative decoding, as vLLM's ``speculative_config``: {"method": "ngram" | "mtp" | "dspark",
    # "num_speculative_tokens": k, ...} (dict or its JSON text; see flashserve.engine.spec_config). "auto": the
    # drafter the checkpoint ships, if any (spec_config.shipped_drafter); None or "off": no speculation.
    speculative_config: dict | str | None = "auto"
    # Parallel layout (flashserve.parallel), vLLM's names: ranks = tensor_parallel_size x data_parallel_size
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    # Seconds a sharded engine waits on a worker (a reply, a collective) before it declares it hung and stops
    worker_timeout: float = 60.0
    # Seconds a sharded engine waits at start-up for its ranks to meet and every worker to load its shard
    startup_timeout: float = 3600.0
