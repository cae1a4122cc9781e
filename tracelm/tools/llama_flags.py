"""llama.cpp's `llama-cli` options on `tracelm run` and `tracelm chat`, so that a script written for llama.cpp runs
unchanged or stops with a line that says why.

Each option llama-cli takes is one of:
- the same thing under tracelm's own name (-n/--predict, -r/--reverse-prompt as a stop string, --ignore-eos, -e);
- about memory, devices, batching or logging, with nothing to change in tracelm (`IGNORED`): accepted, and named on
  stderr with the reason, so that nobody believes it did something;
- a sampler tracelm does not have (`NEUTRAL`): accepted only at the value that turns it off, else an error naming it;
- an interactive mode `tracelm run` does not have (`REFUSED`): an error that names the command that has it.

Without these, argparse would read `-fa` as `-f a`, `-tb 4` as `-t b`, `-sys` as `-s ys` and `-cnv` as `-c nv`,
and fail with a message about another option.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

# (option strings, nargs: 0 a switch, "?" an optional value, 1 a value; why tracelm ignores it)
IGNORED: tuple[tuple[tuple[str, ...], Any, str], ...] = (
    (("-ngl", "--n-gpu-layers", "--gpu-layers"), 1, "tracelm computes on the CPU"),
    (("-dev", "--device"), 1, "tracelm computes on the CPU"),
    (("-b", "--batch-size"), 1, "a prompt is one pass"),
    (("-ub", "--ubatch-size"), 1, "a prompt is one pass"),
    (("-tb", "--threads-batch"), 1, "-t sets the threads of prefill and decode alike"),
    (("-fa", "--flash-attn"), "?", "tracelm's attention is one kernel, whose numbers no option changes"),
    (("--mlock",), 0, "the weights are read into memory as the kernels lay them out"),
    (("--no-mmap",), 0, "the weights are read into memory as the kernels lay them out"),
    (("--numa",), 1, "the kernels' threads are placed by the OS"),
    (("--no-warmup",), 0, "tracelm runs no warm-up pass"),
    (("--prompt-cache",), 1, "a prompt is prefilled each run (sessions keep a conversation's cache: tracelm chat)"),
    (("--color", "-co"), "?", "tracelm's output is plain text"),
    (("--simple-io",), 0, "tracelm's output is plain text"),
    (("--no-display-prompt",), 0, "tracelm prints only the generated text"),
    (("--log-disable",), 0, "tracelm logs only errors and the closing figures, on stderr"),
    (("--no-perf",), 0, "the closing figures go to stderr"),
    (("-lv", "--verbosity", "--log-verbosity"), 1, "tracelm logs only errors and the closing figures, on stderr"),
    (("--jinja",), 0, "chat templates are always rendered by Jinja"),
)
# llama-server's, on serve: nothing to change in tracelm's server
SERVE_IGNORED: tuple[tuple[tuple[str, ...], Any, str], ...] = (
    (("--metrics",), 0, "/metrics is always served"),
    (("--embeddings", "--embedding"), 0, "/v1/embeddings is always served"),
    (("--slots", "--no-slots"), 0, "tracelm's server has no slots endpoint"),
    (("-cb", "--cont-batching", "-nocb", "--no-cont-batching"), 0, "requests join the pass as they come "
     "(server.max_batch)"),
    (("--threads-http",), 1, "requests are read by the server's own threads"),
    (("--cache-reuse",), 1, "a session_id keeps a conversation's cache"),
    (("-sps", "--slot-prompt-similarity"), 1, "a session_id keeps a conversation's cache"),
    (("-kvu", "--kv-unified"), 0, "each sequence has its own Cache"),
    (("-nkvo", "--no-kv-offload"), 0, "tracelm computes on the CPU"),
    (("-dt", "--defrag-thold"), 1, "each sequence's Cache is contiguous"),
    (("--log-format",), 1, "tracelm logs only errors, on stderr"),
    (("-v", "--verbose"), 0, "tracelm logs only errors, on stderr"),
)
# samplers tracelm does not have: (option strings, the value that turns it off)
NEUTRAL: tuple[tuple[tuple[str, ...], float], ...] = (
    (("--typical",), 1.0), (("--mirostat",), 0.0), (("--dry-multiplier",), 0.0), (("--xtc-probability",), 0.0),
    (("--dynatemp-range",), 0.0), (("--top-nsigma",), -1.0),
)
# run: llama-cli's interactive modes, which `tracelm chat` is
REFUSED_ON_RUN: tuple[tuple[str, ...], ...] = (
    ("-cnv", "--conversation"), ("-i", "--interactive"), ("--interactive-first",), ("-sys", "--system-prompt"),
    ("--in-prefix",), ("--in-suffix",),
)


class _Ignored(argparse.Action):
    """Records (option, value) in args.llama_ignored, with the reason the table gives."""

    def __init__(self, *args: Any, reason: str = "", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: str | None = None) -> None:
        said = f"{option} {value}" if value not in (None, [], True) else str(option)
        ns.llama_ignored = [*(getattr(ns, "llama_ignored", None) or []), f"{said} ({self.reason})"]


class _Neutral(argparse.Action):
    def __init__(self, *args: Any, neutral: float = 0.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.neutral = neutral

    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: str | None = None) -> None:
        if value != self.neutral:
            parser.error(f"{option} {value:g}: tracelm has no such sampler; only {self.neutral:g} (off) is accepted")


class _Refused(argparse.Action):
    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, option: str | None = None) -> None:
        parser.error(f"{option}: tracelm run is one completion without a chat template; a conversation (with a "
                     "system prompt, -sys) is `tracelm chat`")


def add_llama_options(sp: argparse.ArgumentParser, command: str) -> None:
    """llama.cpp's options on `tracelm run` or `chat` (see the module docstring); on `serve` and `batch` the ignored
    ones alone (llama-server's -ngl, -fa, ...), those spelled like an option the command has (batch's --batch-size)
    left to it."""
    sp.set_defaults(llama_ignored=None)
    g = sp.add_argument_group("llama.cpp's options", "accepted for llama.cpp's scripts: each does what it says, or "
                              "is named on stderr as changing nothing here, or is refused with the reason")
    for names, nargs, reason in IGNORED + (SERVE_IGNORED if command == "serve" else ()):
        if any(n in sp._option_string_actions for n in names):  # noqa: SLF001 -- argparse's own table
            continue  # the command's own option (batch's --batch-size): -b would be read as that, not ignored
        g.add_argument(*names, nargs=nargs if nargs != 1 else None, action=_Ignored, reason=reason,
                       help=f"ignored: {reason}", **({} if nargs == 0 else {"metavar": "X"}))
    for names in (("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")):
        g.add_argument(*names, dest=names[1][2:].replace("-", "_"), metavar="TYPE", help="the KV cache's type, "
                       "keys and values alike: f16, f32 or q8_0 (config key kv_cache)")
    g.add_argument("--rope-scale", type=float, metavar="N", help="linear RoPE scaling: the context stretched N times "
                   "(config key rope_scale)")
    g.add_argument("--rope-freq-scale", type=float, metavar="F", help="the same as --rope-scale 1/F")
    g.add_argument("--rope-scaling", choices=("none", "linear"), help="tracelm's RoPE scaling is linear (yarn is "
                   "not supported)")
    if command == "serve":
        g.add_argument("-np", "--parallel", type=int, metavar="N", help="sequences decoded together in one pass, "
                       "1 to 8 (server.max_batch)")
        g.add_argument("-a", "--alias", metavar="NAME", help="the model's id in /v1/models and the answers "
                       "(server.alias)")
        g.add_argument("-to", "--timeout", dest="http_timeout", type=float, metavar="S", help="seconds from a "
                       "request's arrival to its last token (server.request_timeout)")
        g.add_argument("--pooling", choices=("mean", "last"), help="/v1/embeddings' pooling (server.pooling)")
    if command in ("serve", "batch"):
        return
    for names, neutral in NEUTRAL:
        g.add_argument(*names, type=float, action=_Neutral, neutral=neutral, metavar="X",
                       help=f"a sampler tracelm does not have: accepted at {neutral:g} (off) only")
    g.add_argument("-r", "--reverse-prompt", action="append", metavar="TEXT", help="stop when the output shows TEXT "
                   "(repeatable; the config's stop strings)")
    if command != "run":
        return
    g.add_argument("-no-cnv", "--no-conversation", nargs=0, action=_Ignored, help="ignored: tracelm run is one "
                   "completion, never a conversation", reason="tracelm run is one completion, never a conversation")
    for names in REFUSED_ON_RUN:
        g.add_argument(*names, nargs="?", action=_Refused, metavar="X", help="refused: a conversation is `tracelm "
                       "chat`")
    g.add_argument("--ignore-eos", action="store_true", help="go on past end-of-generation tokens (a bias of -100 "
                   "on each, as the server's ignore_eos)")
    e = g.add_mutually_exclusive_group()
    e.add_argument("-e", "--escape", action="store_true", help="read \\n \\r \\t \\' \\\" \\\\ and \\xNN "
                   "in the prompt and -r as the characters they name (llama.cpp's default; tracelm's is the text as "
                   "given)")
    e.add_argument("--no-escape", dest="escape", action="store_false", help="the prompt as given (the default)")


_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|[nrt'\"\\])")
_NAMED = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def process_escapes(text: str) -> str:
    """llama.cpp's -e: \\n \\r \\t \\' \\" \\\\ and \\xNN as the characters they name; any other backslash stays."""
    return _ESCAPE.sub(lambda m: chr(int(m[1][1:], 16)) if m[1][0] == "x" else _NAMED[m[1]], text)


def llama_settings(args: argparse.Namespace) -> list[str]:
    """The config settings (`--set` KEY=VALUE) llama.cpp's options that are not one flag for one key ask for: -ctk /
    -ctv (one KV cache type for both: two different ones are refused) and --rope-scale / --rope-freq-scale (serve's
    -np, -a, -to and --pooling are cli.OPTION_KEYS')."""
    import json

    from tracelm.state.errors import TracelmError

    out = []
    k, v = getattr(args, "cache_type_k", None), getattr(args, "cache_type_v", None)
    if k is not None and v is not None and k != v:
        raise TracelmError(f"-ctk {k} -ctv {v}: tracelm's KV cache holds keys and values in one type (kv_cache)")
    if (k or v) is not None:
        out.append(f"kv_cache={json.dumps((k or v).lower())}")
    scale, freq = getattr(args, "rope_scale", None), getattr(args, "rope_freq_scale", None)
    if scale is not None and freq is not None and abs(scale * freq - 1) > 1e-9:
        raise TracelmError(f"--rope-scale {scale:g} and --rope-freq-scale {freq:g} disagree (one is 1 / the other)")
    if freq is not None and not freq > 0:
        raise TracelmError(f"--rope-freq-scale {freq:g}: must be > 0")
    if scale is not None or freq is not None:
        out.append(f"rope_scale={json.dumps(scale if scale is not None else 1 / freq)}")
    return out


def ignored_note(args: argparse.Namespace) -> str | None:
    """The stderr line naming the llama.cpp options given that change nothing here, or None."""
    ignored = getattr(args, "llama_ignored", None)
    return f"tracelm: ignored: {'; '.join(ignored)}" if ignored else None
