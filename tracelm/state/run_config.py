"""RunConfig: what a run does (model, context, sampling, trace, threads), as read from YAML."""

from __future__ import annotations

import attrs
from attrs import validators as v

from tracelm.state.records import SamplingParams

WEIGHT_MODES = ("resident", "streamed")
COMPUTE_MODES = ("kernels", "reference")
CONTEXT_POLICIES = ("stop", "shift")
ACTIVATION_MODES = {"int8": 1, "int16": 2}  # -> int8 blocks per weight block (QMatrix.halves)
KV_CACHE_DTYPES = ("f16", "f32", "q8_0")  # what the Cache holds keys and values in
# the types `quantize` (and `tracelm quantize --type`) turns float matrices into (tracelm/io/quantize.py)
QUANT_NAMES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
# bounds the server also applies to a request (tracelm/server/params.py), so a config and a request agree
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_SEED = (1 << 63) - 1
MAX_THREADS = 256  # the kernels' thread pool holds at most this many (kernels.set_threads)
MAX_CONTEXT = 1 << 27  # positions: beyond any model's trained context (a bound before any size is computed from it)


def _check_stops(_cfg: object, _field: object, stops: tuple[str, ...]) -> None:
    if len(stops) > MAX_STOPS:
        raise ValueError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters, got {s!r}")


def _check_seed(_cfg: object, _field: object, sampling: SamplingParams) -> None:
    seed = sampling.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"sampling.seed {seed!r} is not an integer from 0 to {MAX_SEED}")


@attrs.frozen(slots=True)
class TraceOptions:
    level: str = attrs.field(default="off", validator=v.in_(("off", "summary", "digest")))
    file: str | None = None
    sign_key: str | None = None  # an Ed25519 private key (PEM, `tracelm trace keygen`): each trace's footer is signed
    # "ephemeral": an Ed25519 key made in memory when the run starts, never written anywhere, signs every trace (and
    # attestation evidence binds it: `attest`)
    key: str | None = attrs.field(default=None, validator=v.optional(v.in_(("ephemeral",))))
    policy: str | None = None  # the auditor's trust policy (YAML) the server's viewer and verify route judge by


@attrs.frozen(slots=True)
class AttestOptions:
    """Attestation evidence binding the ephemeral trace key to the TEE the run is in (docs/trust.md): a TPM 2.0
    quote (tpm2-tools) or a configfs-tsm report (SEV-SNP, TDX)."""

    provider: str = attrs.field(default="off", validator=v.in_(("off", "tpm", "tsm")))
    tpm_tcti: str | None = None  # tpm2-tools' TCTI (default: $TPM2TOOLS_TCTI, else the TPM device)
    tpm_ak_handle: str = "0x81010002"  # the persistent attestation key (`tracelm attest tpm-setup`)
    tpm_pcrs: str = "sha256:0,1,2,3,4,5,6,7,23"  # the PCRs quoted (tpm2-tools' selection)
    tpm_ak_cert: str | None = None  # the AK's certificate chain (PEM), put into the evidence (a cloud vTPM's)
    tsm_dir: str = "/sys/kernel/config/tsm/report"  # configfs-tsm's report directory


@attrs.frozen(slots=True)
class ServerOptions:
    """`tracelm serve`: where it listens and the bounds that keep it serving under load."""

    host: str = "127.0.0.1"  # loopback only unless told otherwise
    port: int = attrs.field(default=8080, validator=[v.ge(0), v.le(65535)])
    # requests the engine holds besides one (decoding or waiting); one more gets 429
    queue_size: int = attrs.field(default=8, validator=v.ge(0))
    # sequences decoded together in one pass (at most 8: the weight products' rows stay bitwise row-invariant)
    max_batch: int = attrs.field(default=8, validator=[v.ge(1), v.le(8)])
    request_timeout: float = attrs.field(default=300.0, validator=v.gt(0))  # seconds from arrival to the last token
    max_body_bytes: int = attrs.field(default=1 << 20, validator=v.gt(0))  # larger request bodies get 413
    max_sessions: int = attrs.field(default=16, validator=v.ge(0))  # conversations whose KV cache is kept (LRU)
    session_memory_mb: int = attrs.field(default=1024, validator=v.ge(0))  # and the KV memory they may hold
    api_key_env: str = "TRACELM_API_KEY"  # when this environment variable is set, requests need its value
    trace_dir: str | None = None  # one trace file per request here (at trace.level, digest if "off")
    # the traces in trace_dir take at most this: past it the oldest are deleted (down to 90 % of it)
    traces_max_mb: int = attrs.field(default=1024, validator=v.ge(1))
    # session_id conversations also saved here (tracelm/io/session_file.py): they survive a restart
    sessions_dir: str | None = None
    sessions_max_mb: int = attrs.field(default=2048, validator=v.ge(1))  # disk the saved ones may take (LRU out)
    # a request naming another model than the loaded one is a 404 (by default the loaded model serves any name)
    strict_model: bool = False
    alias: str | None = None  # the model's id in /v1/models and the answers (llama-server's --alias); None: its name
    # /v1/embeddings: a text's vector is the mean of its positions' final hidden states, or the last one's
    pooling: str = attrs.field(default="mean", validator=v.in_(("mean", "last")))
    header_timeout: float = attrs.field(default=10.0, validator=v.gt(0))  # seconds to send a request head, else closed
    max_header_bytes: int = attrs.field(default=65536, validator=v.ge(1024))  # a larger request head gets 431
    # seconds from the end of a request head to the end of its body; a slower body: 408 and the connection closed
    body_timeout: float = attrs.field(default=20.0, validator=v.gt(0))
    # CPU seconds (the process's, shared among the sequences of a pass) a request may use; then it stops (0 = no limit)
    request_cpu_seconds: float = attrs.field(default=600.0, validator=v.ge(0))
    max_upload_mb: int = attrs.field(default=64, validator=v.ge(1))  # a trace posted to the viewer: larger gets 413
    # host names the pages, their API and browsers' requests are answered under, besides IP addresses, localhost
    # and server.host (a DNS-rebinding page's requests carry its own name: 403)
    allowed_hosts: tuple[str, ...] = ()


@attrs.frozen(slots=True)
class SpeculativeOptions:
    """Prompt-lookup speculative decoding: each decode pass also feeds up to `draft_tokens` tokens guessed
    from an earlier occurrence of the last `ngram` tokens; the output is the same as without it."""

    draft_tokens: int = attrs.field(default=0, validator=v.ge(0))  # 0 = off
    ngram: int = attrs.field(default=8, validator=v.ge(1))  # longest context match tried; a match of n earns 2^n
    draft_model: str | None = None  # a smaller model with the same vocabulary guesses instead (registry name or path)


@attrs.frozen(slots=True)
class RunConfig:
    model: str = "smollm2-135m-instruct"  # registry name or path to a GGUF file
    tokenizer: str | None = None  # a tokenizer file replacing the model's own (needed by a llama2.c .bin)
    # resident: every weight in f32 in memory; streamed (a GGUF only): weights stay quantized in the mapped file,
    # each block dequantized into one reused buffer as it runs (little RAM, slower, the same logits)
    weights: str = attrs.field(default="resident", validator=v.in_(WEIGHT_MODES))
    # kernels: the weight products on the quantized blocks in tracelm's compiled kernels (bit-exact at any batch
    # and thread count); reference: every weight dequantized to f32 and multiplied by numpy (the readable math)
    compute: str = attrs.field(default="kernels", validator=v.in_(COMPUTE_MODES))
    # compute: kernels, quantized weights: the activations entering a product, per block, as int16 (two int8
    # blocks, hi and lo: ~15 bits, logits within 0.05 of transformers') or int8 (one int8 block: the precision of
    # llama.cpp's q8 activations, half the integer work: ~1.7x prefill, ~1.15x decode; logits ~1 off on SmolLM2)
    activations: str = attrs.field(default="int16", validator=v.in_(tuple(ACTIVATION_MODES)))
    # the Cache's keys and values: f16 (llama.cpp's default: half the memory and the bytes attend reads per token;
    # each key and value rounded to nearest f16 as it is stored), f32 (as computed) or q8_0 (ggml's blocks of 32:
    # an f16 scale and 32 int8, ~half of f16's bytes; scores as integer dot products with the query rounded alike:
    # docs/architecture.md, stages/attention.py)
    kv_cache: str = attrs.field(default="f16", validator=v.in_(KV_CACHE_DTYPES))
    # a model's F32/F16/BF16 matrices quantized as they load (a Hugging Face folder's, a float GGUF's; blocks already
    # quantized stay as they are), llama-quantize's choice of type per tensor; null = as stored
    quantize: str | None = attrs.field(default=None, validator=v.optional(v.in_(QUANT_NAMES)))
    context: int = attrs.field(default=2048, validator=[v.gt(0), v.le(MAX_CONTEXT)])  # positions the Cache holds
    # chat, when a turn's prompt + max_tokens no longer fits the context: stop (an error; the reply cut to the
    # room left) or shift (keep the system prompt and the latest shift_keep tokens of the conversation, recompute)
    context_policy: str = attrs.field(default="stop", validator=v.in_(CONTEXT_POLICIES))
    shift_keep: int = attrs.field(default=0, validator=v.ge(0))  # shift: tokens kept; 0 = half the context
    threads: int = attrs.field(default=0, validator=[v.ge(0), v.le(MAX_THREADS)])  # kernel (and BLAS) threads; 0: all
    max_tokens: int = attrs.field(default=128, validator=v.ge(0))
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_check_stops)  # stop strings
    system: str | None = None  # chat: system prompt (None: the template's default)
    # chat: the chat template in the model's place: a built-in's name (chatml, llama2, gemma) or Jinja text
    # (io/chat_template.py: template_named); None: the model's own
    chat_template: str | None = attrs.field(default=None, validator=v.optional(v.min_len(1)))
    prompt: str = "The capital of France is"
    sampling: SamplingParams = attrs.field(default=SamplingParams(), validator=_check_seed)
    # linear RoPE scaling (position interpolation): every RoPE frequency divided by this. A context beyond the
    # model's trained one is refused unless this stretches the trained context to hold it (context <= trained x
    # rope_scale); 1.0 = the model as trained
    rope_scale: float = attrs.field(default=1.0, validator=[v.ge(1.0), v.le(float(MAX_CONTEXT))])
    # a chat template renders in a worker process under these (tracelm/io/chat_template.py): CPU seconds, and
    # characters of its output or of any string or list it builds
    template_cpu_seconds: float = attrs.field(default=2.0, validator=v.gt(0))
    template_max_chars: int = attrs.field(default=1_000_000, validator=v.ge(1))
    trace: TraceOptions = TraceOptions()
    attest: AttestOptions = AttestOptions()
    speculative: SpeculativeOptions = SpeculativeOptions()
    server: ServerOptions = ServerOptions()
