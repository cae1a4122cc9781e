"""tracelm's one entry point: run | chat | logits | tokenize | models | bench | trace | replay."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from tracelm.state.errors import TracelmError
from tracelm.state.run_config import KV_CACHE_DTYPES, QUANT_NAMES
from tracelm.tools.llama_flags import add_llama_options, ignored_note, llama_settings, process_escapes


def _threads(n: int, compute: str = "kernels") -> Any:
    """session.ThreadLimits, imported only by the commands that run a model (`tracelm tokenize` and --help stay
    light)."""
    from tracelm.session import ThreadLimits

    return ThreadLimits(n, compute)


def _load_config(args: argparse.Namespace) -> Any:
    from tracelm.session import run_config

    overrides = list(args.set or [])
    _model_as_positional(args)
    if getattr(args, "seed", None) == -1:  # llama.cpp's: a seed of the OS's, said here and kept in the config
        import secrets

        args.seed = secrets.randbelow(1 << 32)
        print(f"tracelm: -s -1: seed {args.seed}", file=sys.stderr)
    overrides += llama_settings(args)  # as the other flags: after --set
    if getattr(args, "chat_template_file", None):
        from tracelm.session import MiB, read_regular_text

        args.chat_template = read_regular_text(args.chat_template_file, "--chat-template-file", 4 * MiB)
    note = ignored_note(args)
    if note:
        print(note, file=sys.stderr)
    if getattr(args, "escape", False):  # run -e: llama.cpp's escapes in the prompt and the stop strings
        args.prompt = None if args.prompt is None else process_escapes(args.prompt)
        args.reverse_prompt = [process_escapes(r) for r in args.reverse_prompt or []] or None
    for flag, key in OPTION_KEYS:
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    if getattr(args, "trace", None):
        overrides.append(f"trace.file={json.dumps(args.trace)}")
    if getattr(args, "sign_key", None):
        overrides.append(f"trace.sign_key={json.dumps(os.path.abspath(args.sign_key))}")
    if getattr(args, "attest", None):
        overrides.append(f"attest.provider={args.attest}")
    if getattr(args, "policy", None):
        overrides.append(f"trace.policy={json.dumps(os.path.abspath(args.policy))}")
    cfg = run_config(None, args.config, overrides)
    from tracelm.audit.keys import check_sign_key

    check_sign_key(cfg.trace.sign_key)  # a bad key file: one line now, not after the model loads
    constraint = _constraint(args)
    if constraint is None:
        return cfg
    import attrs

    return attrs.evolve(cfg, sampling=attrs.evolve(cfg.sampling, constraint=constraint))


# command-line options -> the config keys they set
OPTION_KEYS = (("prompt", "prompt"), ("max_tokens", "max_tokens"), ("temperature", "sampling.temperature"),
               ("seed", "sampling.seed"), ("context", "context"), ("model", "model"), ("threads", "threads"),
               ("system", "system"), ("top_k", "sampling.top_k"), ("top_p", "sampling.top_p"),
               ("min_p", "sampling.min_p"), ("repeat_penalty", "sampling.repeat_penalty"), ("quantize", "quantize"),
               ("repeat_last_n", "sampling.repeat_last_n"), ("presence_penalty", "sampling.presence_penalty"),
               ("frequency_penalty", "sampling.frequency_penalty"), ("reverse_prompt", "stop"),
               ("chat_template", "chat_template"), ("parallel", "server.max_batch"), ("alias", "server.alias"),
               ("http_timeout", "server.request_timeout"), ("pooling", "server.pooling"))


def _model_as_positional(args: argparse.Namespace) -> None:
    """`tracelm run smollm2-135m-instruct`: a positional that names a model rather than a config is the model."""
    from tracelm.session import positional_is_model

    value = getattr(args, "config", None)
    if value is None or not positional_is_model(value):
        return
    if getattr(args, "model", None) is not None:
        raise TracelmError(f"{value!r} names a model and so does --model: give it once (the positional is a config: "
                           "a YAML file or a packaged config's name)")
    args.model, args.config, args.model_from_positional = value, None, True


def _positional_hint(args: argparse.Namespace, error: TracelmError) -> str:
    """What to add to an error about a model named by the positional that is no file: it could have meant a config."""
    value = getattr(args, "model", None)
    if not getattr(args, "model_from_positional", False) or not value or value not in str(error):
        return ""
    from pathlib import Path

    from tracelm.session import packaged_configs

    if Path(value).expanduser().exists():
        return ""
    return (f" ({value!r} was read as a model; a config is a .yaml file or a packaged config's name: "
            f"{', '.join(packaged_configs())})")


def _stdin_prompt(args: argparse.Namespace) -> None:
    """`echo "Tell me a joke" | tracelm run --model M`: without --prompt, a stdin that is no terminal is the prompt
    (`--prompt -` reads it in any case); an empty one leaves the config's prompt. `-f FILE`: the file's text."""
    if args.file is not None:
        from tracelm.session import MiB, read_regular_text

        text = read_regular_text(args.file, "-f prompt file", 64 * MiB)
        args.prompt = text[:-1] if text.endswith("\n") else text  # one final newline dropped, as llama.cpp does
        return
    if args.prompt not in (None, "-") or (args.prompt is None and _stdin_is_terminal()):
        return
    try:
        text = sys.stdin.read()
    except (OSError, ValueError):  # no readable stdin (closed, or a test runner's stand-in)
        text = ""
    if text.endswith("\n"):
        text = text[:-1]
    if args.prompt == "-" and not text:
        raise TracelmError("--prompt -: stdin is empty")
    args.prompt = text or None


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is None or sys.stdin.isatty()
    except (OSError, ValueError):
        return True


def _constraint(args: argparse.Namespace) -> Any:
    """The Constraint that --json, --schema FILE, -j SCHEMA, --grammar FILE (Lark; a .regex file: a regex; a .gbnf
    file: GBNF), --grammar-file FILE (GBNF) or --regex TEXT asks for, or None. GBNF becomes Lark here, so the run
    (and its trace) holds the grammar it applies."""
    from tracelm.state.records import Constraint

    if getattr(args, "json", False):
        return Constraint("json_object")
    if getattr(args, "regex", None) is not None:
        return Constraint("regex", args.regex)
    if getattr(args, "json_schema", None) is not None:
        return Constraint("json_schema", args.json_schema)
    for flag in ("schema", "grammar", "grammar_file"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        from tracelm.session import MiB, read_regular_text

        option = "--" + flag.replace("_", "-")
        text = read_regular_text(path, f"{option} file", 16 * MiB)
        if flag == "grammar_file" or path.endswith(".gbnf"):
            from tracelm.session import lark_of_gbnf

            return Constraint("lark", lark_of_gbnf(text, f"{option} {path}"))
        kind = "json_schema" if flag == "schema" else "regex" if path.endswith(".regex") else "lark"
        return Constraint(kind, text.rstrip("\n") if kind == "regex" else text)
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from tracelm.session import Session, decode_rate

    _stdin_prompt(args)
    fill = args.max_tokens in (-1, -2)  # llama.cpp's -n -1 (until the end) / -2 (until the context is full)
    if fill:
        args.max_tokens = None
    with Session(config=_load_config(args)) as session, _interrupt_as_cancel() as interrupted:
        cfg = session.cfg
        ids = session.encode(cfg.prompt)
        max_tokens = max(cfg.context - len(ids), 0) if fill else None  # no context shift: both stop at the context
        session.check(len(ids), max_tokens)  # before the weights load
        key_env = getattr(args, "trace_key_env", None)
        extra = {}
        if args.ignore_eos:  # every end-of-generation token biased by -100 (the server's ignore_eos)
            extra["logit_bias"] = {**dict(cfg.sampling.logit_bias), **dict.fromkeys(session.tokenizer.eog_ids, -100.0)}
        for _ in _echo(session.stream(cfg.prompt, max_tokens=max_tokens, trace_key_env=key_env,
                                      cancel=interrupted.is_set, **extra)):
            pass
        s = session.stats
    sys.stdout.write("\n")
    if interrupted.is_set():
        trace = f"; the trace {cfg.trace.file} ends with an interrupted footer" if cfg.trace.file else ""
        print(f"[interrupted after {s.n_generated} generated tokens{trace}]", file=sys.stderr)
        return 130
    rate = decode_rate(s.n_generated, s.decode_seconds)
    spec = (f", {s.n_generated / max(s.n_passes, 1):.2f} tokens per pass, {s.n_accepted}/{s.n_drafted} drafted "
            "accepted" if s.n_drafted else "")
    print(f"[{s.n_prompt} prompt tokens, {s.n_generated} generated ({s.finish_reason}), "
          f"prefill {s.prefill_seconds:.2f} s, decode {rate:.1f} tok/s{spec}]", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _interrupt_as_cancel() -> Iterator[threading.Event]:
    """The first Ctrl-C sets the event (generation ends after the token being computed, a trace gets its footer);
    a second one interrupts at once. Only the main thread can take SIGINT: elsewhere the event is never set."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def on_sigint(_signum: int, _frame: Any) -> None:
        interrupted.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_chat(args: argparse.Namespace) -> int:
    from tracelm.session import Session
    from tracelm.tools.chat import ChatRepl, chat_lines

    with Session(config=_load_config(args)) as session:
        if sys.stdin.isatty() and not args.message:  # a person at a terminal: the REPL
            return ChatRepl(session, args.session).run()
        return chat_lines(session, args.message or sys.stdin, args.session)


def cmd_batch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tracelm.tools.batch import BatchOptions, run_batch

    _model_as_positional(args)  # CONFIG_OR_MODEL: a model on the defaults
    opts = BatchOptions(_load_config(args), Path(args.input), Path(args.output),
                        Path(args.traces) if args.traces else None, args.strict, args.engine, args.address,
                        args.actors, args.cpus_per_actor, args.batch_size)
    report = run_batch(opts)
    print(report.describe(), file=sys.stderr)
    return 1 if report.failed else 0


def _echo(pieces: Iterator[str]) -> Iterator[str]:
    """Stream text pieces to stdout as they come, passing them on."""
    for p in pieces:
        sys.stdout.write(p)
        sys.stdout.flush()
        yield p


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    from tracelm.session import Session

    with Session(args.model, settings=[f"compute={args.compute}"]) as session:
        ids = session.encode(args.prompt)
        logits = session.logits(ids)
    np.save(args.out, logits.astype(np.float32))
    print(f"{args.out}: logits [{logits.shape[0]}, {logits.shape[1]}] for ids {ids}", file=sys.stderr)
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from tracelm.tools.tokenize import read_text_file, split_inputs, tokenize_lines

    if (args.text is None) == (args.input_file is None):
        raise TracelmError("tokenize: give exactly one of --text or --input-file")
    if args.text is not None:
        inputs = [args.text]
    else:  # --decode reads one list of ids per line; --separator then separates the texts it prints
        inputs = split_inputs(read_text_file(args.input_file), None if args.decode else args.separator)
    for line in tokenize_lines(args.model, inputs, args.decode, args.separator, args.add_special,
                               args.parse_special, args.skip_special):
        sys.stdout.write(line + "\n")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from tracelm.tools import model_files

    if args.action == "list":
        print("\n".join(model_files.model_lines()))
    elif args.action == "pull":
        print(model_files.pull(args.name, progress=not args.quiet))
    else:
        print(model_files.model_path(args.name))
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from tracelm.tools import model_files

    print(model_files.pull(args.name, progress=not args.quiet))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tracelm.tools.bench import bench_kernel_types, bench_kernels, context_scaling, run_bench, trace_overhead

    if args.compare and (args.what != "model" or args.trace_overhead):
        what = "--trace-overhead" if args.trace_overhead else args.what
        raise TracelmError(f"bench {what}: --compare applies to the model bench only")
    if args.what == "tokenizer":
        from tracelm.tools.tokenize import tokenizer_report

        report = tokenizer_report(args.model, args.input_file)
    if args.compare:  # each engine in its own child process, which sets its own threads
        from tracelm.tools.bench_compare import agreement_line, format_table, run_compare

        engines = [e.strip() for e in args.engines.split(",") if e.strip()]
        report = run_compare(args.model, args.threads, args.prompt_tokens, args.decode_tokens, args.repeats or 3,
                             engines=engines, activations=args.activations, rounds=args.rounds,
                             agree_tokens=args.agree_tokens, llama_bench=args.llama_bench, progress=True,
                             turn_steps=args.turn_steps)
        print(json.dumps(report, indent=2) if args.json else format_table(report))
        if not report["agreement"]["ok"] and not args.allow_disagreement:
            print(f"tracelm: {agreement_line(report['agreement'])} (--allow-disagreement to accept)", file=sys.stderr)
            return 1
        return 0
    if args.llama_bench or args.allow_disagreement:
        raise TracelmError("bench: --llama-bench and --allow-disagreement apply to --compare only")
    if (args.k_ahead or args.prefetch_hints) and args.what != "paths":
        raise TracelmError("bench: --k-ahead and --prefetch-hints apply to bench paths only")
    if args.thread_counts is not None and args.what != "profile":
        raise TracelmError("bench: --thread-counts applies to bench profile only")
    if args.temperature and args.what not in ("profile", "server"):
        raise TracelmError("bench: --temperature applies to bench profile and bench server only")
    if not 0 <= args.temperature < math.inf:
        raise TracelmError(f"bench: --temperature must be finite and >= 0 (0: greedy), got {args.temperature}")
    filters = _bench_filters(args)
    # the Session each model bench opens
    engine = {"compute": args.compute, "threads": args.threads, "activations": args.activations}
    with _threads(args.threads, args.compute):
        if args.what == "tokenizer":
            pass
        elif args.what == "speculative":
            from tracelm.tools.bench_speculative import speculative_bench

            report = speculative_bench(args.model, args.draft_tokens, n_decode=args.decode_tokens, **engine)
        elif args.what == "kernels":
            report = {**bench_kernel_types(), **bench_kernels(args.model, compute=args.compute)}
        elif args.what == "paths":
            from tracelm.tools.bench_paths import bench_paths

            paths = tuple(p.strip() for p in args.paths.split(",") if p.strip()) if args.paths else None
            aheads = _distinct_ints(args.k_ahead, "k-ahead", least=0) if args.k_ahead else ()  # the most: bench_paths
            hints = tuple(dict.fromkeys(h.strip() for h in args.prefetch_hints.split(",") if h.strip())) \
                if args.prefetch_hints else ()  # checked by bench_paths
            report = bench_paths(args.model, args.prompt_tokens, args.decode_tokens, args.repeats or 5, paths, aheads,
                                 hints, **engine)
        elif args.what == "profile":
            from tracelm.tools.bench_profile import bench_profile

            threads = _distinct_ints(args.thread_counts, "thread-counts", 256) if args.thread_counts else ()
            report = bench_profile(args.model, _distinct_ints(args.streams, "streams", 8), args.prompt_tokens,
                                   args.decode_tokens, threads, args.temperature, filters, **engine)
        elif args.what == "batch":
            from tracelm.tools.bench_batch import bench_batch

            report = bench_batch(args.model, args.items, args.decode_tokens, args.actors, **engine)
        elif args.what == "server":
            from tracelm.tools.bench_server import bench_server

            report = bench_server(args.model, _distinct_ints(args.streams, "streams", 8), n_decode=args.decode_tokens,
                                  repeats=args.repeats or 3, temperature=args.temperature, filters=filters, **engine)
        elif args.trace_overhead:
            report = trace_overhead(args.model, args.decode_tokens, args.repeats or 7, **engine)
        elif args.grammar:
            from tracelm.tools.bench_grammar import grammar_overhead

            report = grammar_overhead(args.model, args.grammar, args.decode_tokens, args.repeats or 3, **engine)
        elif args.positions:
            report = context_scaling(args.model, _distinct_ints(args.positions, "positions"), kv_cache=args.kv_cache,
                                     **engine)
        else:
            report = run_bench(args.model, args.prompt_tokens, args.decode_tokens, args.context, args.weights,
                               kv_cache=args.kv_cache, **engine)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report.items():
            print(f"{k:34s} {v}")
    return 0


def _bench_filters(args: argparse.Namespace) -> dict[str, float]:
    """bench profile / server's --top-k, --top-p, --min-p: the sampled streams' filters in the defaults' place."""
    filters = {k: v for k, v in (("top_k", args.top_k), ("top_p", args.top_p), ("min_p", args.min_p)) if v is not None}
    if filters and (args.what not in ("profile", "server") or not args.temperature):
        raise TracelmError("bench: --top-k, --top-p and --min-p apply to bench profile and bench server with "
                           "--temperature > 0")
    from tracelm.state.records import SamplingParams

    for key, value in filters.items():
        try:
            SamplingParams(**{key: value})
        except (TypeError, ValueError) as e:
            raise TracelmError(f"bench: --{key.replace('_', '-')} {value}: {e}") from None
    return filters


def _distinct_ints(text: str, flag: str, most: int | None = None, least: int = 1) -> tuple[int, ...]:
    """`--FLAG a,b,c` (--positions, --streams, --thread-counts, --k-ahead): distinct integers of `least` to `most`
    (any from `least` on when None), in the order given, the first the baseline of the ratios."""
    try:
        values = tuple(int(n) for n in text.split(","))
    except ValueError:
        values = ()
    distinct = len(set(values)) == len(values)
    if not values or min(values) < least or (most is not None and max(values) > most) or not distinct:
        want = f"distinct counts of {least} to {most}" if most is not None else f"distinct integers from {least} on"
        raise TracelmError(f"--{flag} {text!r}: expected {want} separated by commas")
    return values


def cmd_trace(args: argparse.Namespace) -> int:
    from tracelm.audit.keys import keygen
    from tracelm.audit.verify import read_trace, summary
    from tracelm.session import trace_key

    if args.action == "keygen":
        if not args.out:
            raise TracelmError("trace keygen: give --out FILE (the private key; FILE.pub gets the public key)")
        print(keygen(args.out))
        return 0
    if args.trace is None:
        raise TracelmError(f"trace {args.action}: give the TRACE file")
    if args.action in ("view", "plot"):
        return _trace_view_or_plot(args)
    if args.action == "show":
        print(summary(read_trace(args.trace)))
        return 0
    from tracelm.audit.trust import judge  # cryptography: only where a signature or evidence is checked

    policy = _policy(args)
    trace = read_trace(args.trace)
    verdict = judge(trace, policy, trace_key(args.key_env) if args.key_env else None, args.key_env)
    if args.json:
        print(json.dumps({"trace": args.trace, **verdict.as_dict()}, indent=1))
    else:
        print(f"{args.trace}: {'TAMPERED: ' if verdict.level == 'broken' else ''}{verdict.describe()}")
    return verdict.exit_status


def _policy(args: argparse.Namespace) -> Any:
    """The auditor's policy: --policy FILE, each --public-key FILE trusted, --require LEVEL."""
    from tracelm.audit.policy import load_policy

    return load_policy(getattr(args, "policy", None), tuple(getattr(args, "public_key", None) or ()),
                       getattr(args, "require", None))


def _trace_view_or_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.action == "plot":
        from tracelm.tools.trace_plot import plot_trace

        if not args.out:
            raise TracelmError("trace plot: give --out FILE.png")
        print(plot_trace(Path(args.trace), Path(args.out), args.token, args.stat), file=sys.stderr)
        return 0
    from tracelm.server.pages import TraceKey, serve_viewer
    from tracelm.session import trace_key

    key = TraceKey(trace_key(args.key_env), args.key_env) if args.key_env else None
    serve_viewer(Path(args.trace), Path(args.replay) if args.replay else None, key, args.port, _policy(args))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from tracelm.audit.replay import replay
    from tracelm.session import trace_key

    key = trace_key(args.key_env) if args.key_env else None
    report = replay(args.trace, args.model, args.allow_model_change, key, policy=_policy(args), key_name=args.key_env)
    print(json.dumps({"trace": args.trace, **report.as_dict()}, indent=1) if args.json else report.describe())
    return report.exit_status


def cmd_attest(args: argparse.Namespace) -> int:
    """`tracelm attest verify FILE`: evidence (GET /v1/attestation's answer, a raw SEV-SNP report or TDX quote)
    under the policy; `tracelm attest tpm-setup`: the TPM's EK and AK made persistent, the AK's public key written."""
    if args.action == "pcr":
        from tracelm.tools.attest import pcr_after

        print("\n".join(pcr_after(args.file_list)))
        return 0
    if args.action == "tpm-setup":
        from tracelm.tools.attest import setup

        if not args.out:
            raise TracelmError("attest tpm-setup: give --out FILE (the AK's public key, PEM, for the auditor)")
        print(setup(args.tcti, args.out))
        return 0
    from tracelm.audit.trust import verify_document

    if len(args.file_list) != 1:
        raise TracelmError("attest verify: give one evidence FILE")
    path = args.file_list[0]
    verdict = verify_document(path, _policy(args), args.nonce)
    print(json.dumps({"file": path, **verdict.as_dict()}, indent=1) if args.json else f"{path}: {verdict.describe()}")
    return verdict.exit_status


def cmd_validate(args: argparse.Namespace) -> int:
    from tracelm.tools.validate import DEFAULT_PROMPTS, run_validate

    with _threads(args.threads, args.compute):
        return run_validate(args.model, args.reference, args.prompt or DEFAULT_PROMPTS, args.tokens, args.json,
                            args.compute)


def _api_key_file(path: str) -> str:
    """The key in `path`: its first line, without surrounding whitespace; an empty one is an error."""
    from tracelm.session import read_regular_text

    lines = read_regular_text(path, "--api-key-file", 64 * 1024).splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise TracelmError(f"{path}: --api-key-file holds no key on its first line")
    return key


def cmd_serve(args: argparse.Namespace) -> int:
    from tracelm.server import serve

    for flag, key in (("sessions", "sessions_dir"), ("sessions_max_mb", "sessions_max_mb"),
                      ("header_timeout", "header_timeout"), ("max_header_bytes", "max_header_bytes"),
                      ("request_cpu_seconds", "request_cpu_seconds")):
        value = getattr(args, flag)
        if value is not None:
            args.set = [*(args.set or []), f"server.{key}={json.dumps(value)}"]
    if args.strict_model:
        args.set = [*(args.set or []), "server.strict_model=true"]
    if args.api_key is not None:
        raise TracelmError("serve: --api-key is refused: a key on the command line is visible to every user of this "
                           "machine (ps); put it in a file for --api-key-file, or in TRACELM_API_KEY")
    key = _api_key_file(args.api_key_file) if args.api_key_file else None
    serve(_load_config(args), args.host, args.port, key)  # the server's Session sets the config's thread limits
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    from tracelm.tools.soak import describe, soak

    report = soak(_load_config(args), args.clients, args.requests, args.sessions, args.trace_requests,
                  args.max_tokens or 16, args.seed or 0)
    print(json.dumps(report, indent=1) if args.json else describe(report))
    return 0 if report["verdict"] == "PASS" else 1


def cmd_check(args: argparse.Namespace) -> int:
    from tracelm.tools.check_structured import structured_output_check

    report = structured_output_check(args.model, args.seeds, args.temperature, args.threads)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report["runs"]:
            print(f"seed {r['seed']:3d}: {'valid' if r['valid'] else 'INVALID: ' + str(r['why'])}"
                  + (f" ({r['tokens']} tokens, {r['finish_reason']})" if "tokens" in r else ""))
        t, n = report["tools"], report["n"]
        print(f"tools: {'valid' if t['valid'] else 'INVALID: ' + str(t['why'])}" + (
              f" ({t['calls']} call(s), {t['name']}({t['arguments']}), {t['finish_reason']})" if t["calls"] else ""))
        print(f"n={len(n['choices'])}: {'valid' if n['valid'] else 'INVALID: ' + str(n['why'])}" + (
              f" (prefill_passes {n['usage']['prefill_passes']})" if "prefill_passes" in n["usage"] else ""))
        print(f"{report['model']}: {report['valid']} replies validate against the schema ({report['seconds']} s)")
    return 0 if report["passed"] else 1


def cmd_fuzz(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from tracelm.tools.fuzz import FuzzOptions, run_fuzz, summary

    opts = FuzzOptions(args.target, args.count, args.seed, args.timeout_s, Path(args.crash_dir), args.memory_mb)
    t0 = time.perf_counter()
    reports = run_fuzz(opts)
    print(summary(reports, opts, time.perf_counter() - t0))
    return 1 if any(r.failed for r in reports) else 0


def cmd_export(args: argparse.Namespace) -> int:
    from tracelm.tools.model_files import export

    print(export(args.model, args.out, args.tokenizer), file=sys.stderr)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from tracelm.tools.model_files import export

    print(export(args.input, args.output, args.tokenizer, args.type), file=sys.stderr)
    return 0


CONFIG_HELP = ("a YAML run config (a file, or a packaged config's name: smollm2, gemma3, qwen2.5-coder, stories260k), "
               "or a model (a registry name or a model path, as --model takes); default: the built-in defaults")


def build_parser() -> argparse.ArgumentParser:
    from tracelm.version import __version__

    p = argparse.ArgumentParser(prog="tracelm", description="Auditable LLM inference on the CPU.")
    p.add_argument("--version", action="version", version=f"tracelm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_run_commands, _add_batch_command, _add_file_commands, _add_audit_commands, _add_bench_command):
        add(sub)
    return p


def _model_options(sp: argparse.ArgumentParser, defaults: str = "") -> None:
    """The model and its engine, as llama.cpp spells them too (-m, -c/--ctx-size, -n/--n-predict, -t)."""
    sp.add_argument("-m", "--model", help="registry name or model path: a GGUF file, a Hugging Face folder, a "
                    "llama2.c .bin; hf:ORG/REPO[:FILE or :QUANT] (downloaded into the Hugging Face cache); a name in "
                    "the local Hugging Face or Ollama cache (`tracelm models list`); or synth:NAME, random weights at "
                    "a registry family's published size (overrides the config's model)")
    _quantize_option(sp)
    sp.add_argument("-c", "--context", "--ctx-size", dest="context", type=int, metavar="N",
                    help="positions of the KV cache: prompt + reply (config key context)")
    sp.add_argument("-n", "--max-tokens", "--n-predict", "--predict", dest="max_tokens", type=int, metavar="N",
                    help=f"most tokens to generate{defaults} (max_tokens); `run` takes -1 or -2 as llama.cpp does: as "
                    "many as the context leaves after the prompt")
    sp.add_argument("-t", "--threads", type=int, metavar="N", help="kernel threads; 0 = one per core (threads)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key, e.g. --set "
                    "sampling.min_p=0.1 (repeatable; docs/usage.md lists the keys)")


def _sampling_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--temperature", "--temp", dest="temperature", type=float, metavar="T",
                    help="sampling temperature; 0 = greedy (sampling.temperature)")
    sp.add_argument("-s", "--seed", type=int, help="the sampler's random seed; -1: one drawn from the OS, printed "
                    "(sampling.seed)")
    sp.add_argument("--top-k", type=int, metavar="K", help="keep the K likeliest tokens; 0 = off (sampling.top_k)")
    sp.add_argument("--top-p", type=float, metavar="P", help="keep the likeliest tokens whose probabilities add up to "
                    "P; 1.0 = off (sampling.top_p)")
    sp.add_argument("--min-p", type=float, metavar="P", help="drop tokens less likely than P times the likeliest; "
                    "0 = off (sampling.min_p)")
    sp.add_argument("--repeat-penalty", type=float, metavar="R", help="penalise recently seen tokens; 1.0 = off "
                    "(sampling.repeat_penalty)")
    sp.add_argument("--repeat-last-n", type=int, metavar="N", help="how many recent tokens the penalties look at "
                    "(sampling.repeat_last_n)")
    sp.add_argument("--presence-penalty", type=float, metavar="P", help="subtract P from a token seen in that window "
                    "(OpenAI's; sampling.presence_penalty)")
    sp.add_argument("--frequency-penalty", type=float, metavar="F", help="subtract F times its count there "
                    "(OpenAI's; sampling.frequency_penalty)")


def _system_option(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("-sys", "--system", "--system-prompt", dest="system", metavar="TEXT", help="the system prompt of "
                    "a chat (config key system; default: the chat template's own)")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--chat-template", metavar="NAME_OR_JINJA", help="the chat template in the model's place: chatml, "
                   "llama2, gemma, or Jinja text (config key chat_template)")
    g.add_argument("--chat-template-file", metavar="FILE", help="the chat template in the model's place, read from "
                   "this Jinja file (llama.cpp's flag)")


def _run_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", nargs="?", metavar="CONFIG_OR_MODEL", help=CONFIG_HELP)
    _model_options(sp)
    _sampling_options(sp)
    g = sp.add_mutually_exclusive_group()  # sampling.constraint in a config
    g.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    g.add_argument("--schema", metavar="FILE", help="constrain the output to JSON valid against this JSON schema "
                   "(strict: objects hold only the properties they name)")
    g.add_argument("--grammar", metavar="FILE", help="constrain the output to this Lark grammar (llguidance's "
                   "dialect, rule `start`); a FILE ending in .regex holds a regular expression instead, one ending in "
                   ".gbnf a GBNF grammar")
    g.add_argument("--grammar-file", metavar="FILE", help="constrain the output to this GBNF grammar (llama.cpp's "
                   "format, rule `root`), converted to Lark as it is read")
    g.add_argument("--regex", metavar="TEXT", help="constrain the output to match this regular expression, whole")
    g.add_argument("-j", "--json-schema", metavar="SCHEMA", help="as --schema, the schema given inline as JSON text "
                   "(llama.cpp's -j)")
    _sign_key_option(sp)


def _quantize_option(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--quantize", type=str.lower, choices=QUANT_NAMES, help="quantize the model's F32/F16/BF16 "
                    "matrices as they load (a Hugging Face folder, a float GGUF), as llama-quantize picks types")


def _sign_key_option(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--sign-key", metavar="FILE", help="sign each trace's footer with this Ed25519 private key (PEM, "
                    "`tracelm trace keygen`); `trace verify --public-key FILE.pub` checks it (trace.sign_key)")
    sp.add_argument("--attest", choices=("tpm", "tsm"), help="sign every trace with an Ed25519 key made in memory at "
                    "start (trace.key: ephemeral) and bind it to this TEE's evidence in each trace header: a TPM 2.0 "
                    "quote (tpm2-tools) or a configfs-tsm SEV-SNP / TDX report (attest.provider; docs/trust.md)")


def _add_run_commands(sub: Any) -> None:
    sp = sub.add_parser("run", help="generate text from a prompt, streaming to stdout")
    _run_options(sp)
    g = sp.add_mutually_exclusive_group()
    g.add_argument("-p", "--prompt", help="the text to continue (no chat template: `tracelm chat` applies one); "
                   "default: stdin when it is not a terminal, else the config's prompt; - reads stdin")
    g.add_argument("-f", "--file", metavar="FILE", help="the prompt is this file's text (llama.cpp's -f)")
    sp.add_argument("--trace", metavar="FILE", help="write a JSON-lines trace (level digest by default)")
    sp.add_argument("--trace-key-env", metavar="NAME", help="sign the trace with HMAC-SHA256, key from env var NAME")
    add_llama_options(sp, "run")
    sp.set_defaults(fn=cmd_run)

    sp = sub.add_parser("chat", help="multi-turn chat with the model's chat template (at a terminal: line editing, "
                        "Ctrl-C stops a reply, /help lists the commands; piped: one turn per line of stdin)")
    _run_options(sp)
    _system_option(sp)
    sp.add_argument("--message", action="append", help="a user turn (repeatable) instead of stdin")
    sp.add_argument("--session", metavar="NAME", help="resume the conversation saved as NAME (in TRACELM_HOME/"
                    "sessions) and save it after each reply; a new NAME starts one")
    sp.add_argument("--trace", metavar="FILE", help="write each turn's trace here (its header names the last hash "
                    "of the conversation's previous trace)")
    add_llama_options(sp, "chat")
    sp.set_defaults(fn=cmd_chat)

    sp = sub.add_parser("serve", help="an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, streaming")
    sp.add_argument("config", nargs="?", metavar="CONFIG_OR_MODEL", help=CONFIG_HELP + "; a config's server: "
                    "section sets the limits")
    _model_options(sp, defaults=" when a request gives no max_tokens")
    sp.add_argument("--temperature", "--temp", dest="temperature", type=float, metavar="T",
                    help="default temperature of a request that gives none")
    _system_option(sp)
    sp.add_argument("--host", help="address to listen on (default: server.host of the config, 127.0.0.1)")
    sp.add_argument("--port", type=int, help="port (default: server.port of the config, 8080; 0 = any free port)")
    sp.add_argument("--api-key-file", metavar="FILE", help="require this file's key (its first line) of every request "
                    "but /health and the pages, as llama-server's flag does; default: the variable server.api_key_env "
                    "names, TRACELM_API_KEY")
    sp.add_argument("--api-key", metavar="KEY", help="refused: a key on the command line is visible to every user of "
                    "the machine (ps); use --api-key-file or TRACELM_API_KEY")
    sp.add_argument("--sessions", metavar="DIR", help="also save session_id conversations in DIR, so that they "
                    "survive a restart (server.sessions_dir)")
    sp.add_argument("--sessions-max-mb", type=int, metavar="MB", help="disk the saved sessions may take, least "
                    "recently used deleted first (server.sessions_max_mb, default 2048)")
    sp.add_argument("--strict-model", action="store_true", help="answer 404 to a request naming another model than "
                    "the loaded one (by default any name is served by it, as llama-server and Ollama do)")
    sp.add_argument("--header-timeout", type=float, metavar="S", help="close a connection that has not sent a "
                    "complete request head S seconds after opening or after its last response (server.header_timeout, "
                    "default 10)")
    sp.add_argument("--max-header-bytes", type=int, metavar="N", help="answer 431 to a request head (request line "
                    "and headers) over N bytes (server.max_header_bytes, default 65536)")
    sp.add_argument("--request-cpu-seconds", type=float, metavar="S", help="stop a request after S CPU seconds "
                    "(finish_reason length, or 400 before its first token; server.request_cpu_seconds, default 600, "
                    "0 = no limit)")
    _sign_key_option(sp)
    sp.add_argument("--policy", metavar="FILE", help="the trust policy (YAML, docs/trust.md) the trace viewer and "
                    "POST /api/trace/verify judge traces by (trace.policy; default: no key trusted)")
    add_llama_options(sp, "serve")
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("soak", help="a server (in a child process) under concurrent chat clients over many session "
                        "ids: 5xx count, errors, RSS at start/peak/end against session_memory_mb + model + 200 MB")
    sp.add_argument("config", nargs="?", help=CONFIG_HELP + "; its server: section sets the limits")
    sp.add_argument("--model", help="registry name or model path (overrides the config)")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key")
    sp.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    sp.add_argument("--requests", type=int, default=100, help="chat completions per client (default 100)")
    sp.add_argument("--sessions", type=int, default=40, help="session ids the requests draw from (default 40)")
    sp.add_argument("--trace", dest="trace_requests", action="store_true", help="a trace file per request")
    sp.add_argument("--max-tokens", type=int, help="max_tokens of each request (default 16)")
    sp.add_argument("--seed", type=int, help="the clients' random choices (default 0)")
    sp.add_argument("--json", action="store_true", help="the figures as JSON")
    sp.set_defaults(fn=cmd_soak)


def _add_batch_command(sub: Any) -> None:
    sp = sub.add_parser("batch", help="run a JSON-lines file of prompts (one model load, several sequences per "
                        "pass), appending one result line per item; a re-run resumes", description="CONFIG_OR_MODEL: "
                        "a YAML config (.yaml, or a packaged config's name) or a model (registry name or path). "
                        "Input lines: {\"id\", \"prompt\"} or {\"id\", \"messages\"}, with optional max_tokens, "
                        "stop, temperature, top_k, top_p, min_p, seed, repeat_penalty, repeat_last_n, "
                        "frequency_penalty, presence_penalty. An item without a seed gets one derived from --seed "
                        "and its id.")
    _run_options(sp)
    _system_option(sp)
    sp.add_argument("--input", required=True, metavar="FILE", help="JSON lines, one item each")
    sp.add_argument("--output", required=True, metavar="FILE", help="JSON lines, one result each, appended; ids "
                    "already in it are skipped")
    sp.add_argument("--traces", metavar="DIR", help="keep each item's trace as DIR/<id>.jsonl (verifiable with "
                    "`tracelm trace verify`); the output names it")
    sp.add_argument("--strict", action="store_true", help="stop at the first bad input line (exit 2) instead of "
                    "reporting and skipping it")
    sp.add_argument("--engine", choices=("local", "ray"), default="local",
                    help="local: this process; ray: Ray Data actors, each one model load (pip install 'tracelm[ray]')")
    sp.add_argument("--address", help="ray: join the cluster at this address (e.g. ray://head:10001 or auto); "
                    "default: start a local one")
    sp.add_argument("--actors", type=int, default=2, help="ray: actors (model loads), default 2")
    sp.add_argument("--cpus-per-actor", type=float, default=1.0,
                    help="ray: CPUs each actor reserves, and its threads unless the config sets threads")
    sp.add_argument("--batch-size", type=int, default=8, help="sequences decoded together per pass (1..8)")
    add_llama_options(sp, "batch")
    sp.set_defaults(fn=cmd_batch)


def _add_file_commands(sub: Any) -> None:
    sp = sub.add_parser("logits", help="save f32 logits of every prompt position as .npy [T, vocab]")
    sp.add_argument("--model", required=True)
    sp.add_argument("--prompt", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--compute", choices=("kernels", "reference"), default="kernels",
                    help="kernels: the compiled kernels on the file's blocks; reference: numpy on f32 weights")
    sp.set_defaults(fn=cmd_logits)

    sp = sub.add_parser("tokenize", help="print the token ids of each input as a JSON array, one per line")
    sp.add_argument("--model", required=True,
                    help="model name, GGUF (also vocab-only), SentencePiece .model, tokenizer.json or llama2.c .bin")
    sp.add_argument("--text", help="one input")
    sp.add_argument("--input-file", metavar="FILE", help="inputs from a UTF-8 file: one per line, or see --separator")
    sp.add_argument("--separator", metavar="LINE", help="inputs in the file are separated by lines equal to LINE "
                    "(--decode: printed after each text)")
    sp.add_argument("--parse-special", action="store_true", help="match control tokens written in the text")
    sp.add_argument("--add-special", action="store_true", help="add BOS/EOS as the vocabulary's flags say")
    sp.add_argument("--decode", action="store_true",
                    help="inputs are token ids ([1, 2] or 1 2; one list per line of a file): print their text")
    sp.add_argument("--skip-special", action="store_true", help="--decode: leave control tokens out")
    sp.set_defaults(fn=cmd_tokenize)

    sp = sub.add_parser("export", help="write a model (GGUF, Hugging Face folder, llama2.c .bin) as an f32 GGUF "
                        "with its vocabulary and chat template (`tracelm quantize` for a quantized one)")
    sp.add_argument("--model", required=True, help="registry name or model path")
    sp.add_argument("--tokenizer", help="tokenizer file (a llama2.c .bin model needs one)")
    sp.add_argument("--out", required=True, help="the GGUF file to write")
    sp.set_defaults(fn=cmd_export)

    sp = sub.add_parser("quantize", help="write a model (Hugging Face folder, GGUF, llama2.c .bin) as a quantized GGUF "
                        "that tracelm and llama.cpp read, vocabulary and chat template included")
    sp.add_argument("input", help="registry name or model path (a Hugging Face folder, a GGUF file, a llama2.c .bin)")
    sp.add_argument("output", help="the GGUF file to write")
    sp.add_argument("--type", required=True, type=str.lower, choices=QUANT_NAMES, help="the matrices' type "
                    "(vectors stay f32; the output matrix, or the tied embedding, q6_k as llama-quantize does)")
    sp.add_argument("--tokenizer", help="tokenizer to carry instead of the model's own (a GGUF, or a tokenizer.json "
                    "or its folder; a llama2.c .bin model needs one for the GGUF to hold a vocabulary)")
    sp.set_defaults(fn=cmd_quantize)

    sp = sub.add_parser("models", help="the models tracelm can name -- the registry's and those in the local Hugging "
                        "Face and Ollama caches: list | pull NAME | path NAME")
    sp.add_argument("action", choices=("list", "pull", "path"))
    sp.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(fn=cmd_models)

    sp = sub.add_parser("pull", help="download ORG/REPO[:FILE or :QUANT] from the Hugging Face Hub into its cache "
                        "(HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE apply; a download resumes) or a registry model; prints "
                        "its path, which --model hf:ORG/REPO[...] then names")
    sp.add_argument("name", help="ORG/REPO (a safetensors folder, or its only GGUF), ORG/REPO:FILE.gguf, "
                    "ORG/REPO:Q4_K_M (the GGUF of that quant), or a registry name")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(fn=cmd_pull)


def _add_audit_commands(sub: Any) -> None:
    sp = sub.add_parser("validate", help="compare every layer, the logits and greedy tokens with a reference "
                        "implementation on the same weights (exit 0: within tolerance, 1: not)")
    sp.add_argument("--model", required=True, help="registry name or model path")
    sp.add_argument("--reference", choices=("transformers",), default="transformers")
    sp.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three built-in prompts)")
    sp.add_argument("--tokens", type=int, default=32, help="greedy tokens to compare")
    sp.add_argument("--threads", type=int, default=0)
    sp.add_argument("--compute", choices=("kernels", "reference"), default="reference",
                    help="tracelm's side: the numpy reference (f32), or the kernels, which are also compared with "
                    "the reference (argmax agreement, max |diff| of the logits)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_validate)

    sp = sub.add_parser("trace", help="judge a trace under your trust policy (verify: broken, intact, signed, trusted "
                        "or attested), summarise it (show), open it in the web viewer (view) or draw its stage grid "
                        "and tokens/s (plot), without the model; keygen: a new Ed25519 key pair for --sign-key",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="trace verify exits (docs/trust.md):\n" + _exit_table())
    sp.add_argument("action", choices=("verify", "show", "view", "plot", "keygen"))
    sp.add_argument("trace", metavar="TRACE", nargs="?")
    sp.add_argument("--key-env", metavar="NAME", help="verify, view: also check every line's HMAC, key from env var "
                    "NAME (a secret you share with the operator: a checked HMAC counts as trusted)")
    _trust_options(sp)
    sp.add_argument("--json", action="store_true", help="verify: the verdict and its steps as JSON")
    sp.add_argument("--replay", metavar="REPORT", help="view: also show this `tracelm replay --json` report")
    sp.add_argument("--port", type=int, default=0, help="view: port on 127.0.0.1 (default: any free one)")
    sp.add_argument("--out", metavar="FILE", help="plot: the image to write (.png, .svg, .pdf); keygen: the private "
                    "key to write (mode 0600; FILE.pub gets the public key; never overwrites)")
    sp.add_argument("--token", type=int, help="plot: the pass whose grid is drawn (default: the first decode pass)")
    sp.add_argument("--stat", choices=("rms", "maxabs", "dur_us"), default="rms", help="plot: the grid's statistic")
    sp.set_defaults(fn=cmd_trace)

    sp = sub.add_parser("check", help="structured-output: issue 15's acceptance check -- `tracelm serve` on the model, "
                        "one json_schema chat request per seed 1..N at temperature 0.8, each reply validated by "
                        "jsonschema; then with the openai client a weather tool request (its call's arguments "
                        "validated) and an n=3 request (three choices, one prefill) (exit 0: all valid, 1: not)")
    sp.add_argument("what", choices=("structured-output",))
    sp.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    sp.add_argument("--seeds", type=int, default=20)
    sp.add_argument("--temperature", type=float, default=0.8)
    sp.add_argument("--threads", type=int, default=0)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_check)

    sp = sub.add_parser("fuzz", help="mutation-fuzz a reader of untrusted input: each input must be accepted or "
                        "refused with tracelm's one-line error; prints the counts, crashes by type, hangs and peak "
                        "RSS (exit 1 on any crash or hang)")
    sp.add_argument("target", choices=("gguf", "safetensors", "llama2c", "tokenizer", "trace", "template", "all"))
    sp.add_argument("--count", type=int, default=1000, help="inputs (per target with `all`)")
    sp.add_argument("--seed", type=int, default=0, help="the inputs depend on it alone")
    sp.add_argument("--timeout-s", type=float, default=10.0, help="an input not read within this is a HANG")
    sp.add_argument("--crash-dir", default="fuzz-crashes", help="where each crash or hang input is written")
    sp.add_argument("--memory-mb", type=int, default=2048, help="the reader process's private memory cap "
                    "(RLIMIT_DATA; 0: none): an allocation past it is a MemoryError crash")
    sp.set_defaults(fn=cmd_fuzz)

    sp = sub.add_parser("replay", help="re-run a trace and report the first stage or token where the runs part",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="replay exits (docs/trust.md):\n" + _exit_table(replay=True))
    sp.add_argument("trace", metavar="TRACE")
    sp.add_argument("--model", help="model file or registry name (default: the recorded one)")
    sp.add_argument("--allow-model-change", action="store_true",
                    help="replay even if the model's sha256 differs from the recorded one")
    sp.add_argument("--key-env", metavar="NAME", help="check the trace's HMAC first, key from env var NAME")
    _trust_options(sp)
    sp.add_argument("--json", action="store_true", help="print the report as JSON (`tracelm trace view TRACE "
                    "--replay REPORT` shows it on the trace's grid)")
    sp.set_defaults(fn=cmd_replay)

    sp = sub.add_parser("attest", help="verify attestation evidence under your policy (verify: GET /v1/attestation's "
                        "answer, or a raw SEV-SNP report or TDX quote), make a TPM's attestation key persistent and "
                        "write its public key (tpm-setup), or compute the PCR value files extend to (pcr)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="attest verify exits as trace verify (docs/trust.md):\n" + _exit_table())
    sp.add_argument("action", choices=("verify", "tpm-setup", "pcr"))
    sp.add_argument("file_list", metavar="FILE", nargs="*", help="verify: the evidence; pcr: the files an operator "
                    "extends into a PCR (sha256 bank), in order: prints their sha256 and the PCR's value")
    sp.add_argument("--nonce", metavar="HEX", help="verify: the nonce you sent to GET /v1/attestation (a document "
                    "answering another nonce is refused as replayed)")
    _trust_options(sp)
    sp.add_argument("--json", action="store_true", help="verify: the verdict and its steps as JSON")
    sp.add_argument("--tcti", metavar="TCTI", help="tpm-setup: the TPM (tpm2-tools' TCTI, e.g. "
                    "swtpm:host=127.0.0.1,port=2321; default: $TPM2TOOLS_TCTI)")
    sp.add_argument("--out", metavar="FILE", help="tpm-setup: where the AK's public key (PEM) is written")
    sp.set_defaults(fn=cmd_attest)


def _trust_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--policy", metavar="FILE", help="your trust policy (YAML, docs/trust.md): the keys you trust, "
                    "the level you require, what attestation evidence must show")
    sp.add_argument("--public-key", metavar="FILE", action="append", help="trust this Ed25519 public key (PEM, "
                    "keygen's FILE.pub); repeatable, added to the policy's keys")
    sp.add_argument("--require", choices=("intact", "signed", "trusted", "attested"), help="the lowest verdict that "
                    "exits 0 (default: the policy's require; trusted, or attested with attestation requirements)")


def _exit_table(replay: bool = False) -> str:
    from tracelm.audit.exits import REPLAY_EXIT_TABLE, exit_table

    return exit_table(REPLAY_EXIT_TABLE) if replay else exit_table()


def _add_bench_command(sub: Any) -> None:
    sp = sub.add_parser("bench", help="load time, prefill and decode rates, peak RSS, against the machine's limits "
                        "(`bench tokenizer`: encode/decode throughput; `bench server`: N streams decoded together; "
                        "`bench profile`: a decode step's time by kind of work (products, attention, norms, sampling, "
                        "the rest) for each --streams count, and a --prompt-tokens prefill's; "
                        "`bench batch`: --items prompts as one `tracelm batch` vs separate runs, and on Ray; "
                        "`bench speculative`: prompt-lookup decoding "
                        "vs plain; `bench kernels`: dequantization and "
                        "weight-product rates at the model's shapes (and the part that quantizes x); "
                        "`bench paths`: the kernel paths this CPU runs, "
                        "alternated over --repeats rounds, their rates and ratios to avx2, and their bits compared)")
    sp.add_argument("what", nargs="?",
                    choices=("model", "tokenizer", "kernels", "paths", "profile", "speculative", "server", "batch"),
                    default="model")
    sp.add_argument("--streams", default="1,2,4,8", metavar="N1,N2,...",
                    help="bench server: concurrent streams decoded together through the server's engine (1..8 each); "
                    "aggregate decode tok/s and the ratio to the first; bench profile: the stream counts profiled")
    sp.add_argument("--thread-counts", default=None, metavar="T1,T2,...",
                    help="bench profile: profile at each thread count in turn (one process), with each kind's "
                    "speed-up over the first count: what does not shrink with threads (and the integer dot's peak "
                    "at each: whether the threads have cores of their own)")
    sp.add_argument("--temperature", type=float, default=0.0, metavar="T",
                    help="bench profile, bench server: the streams sample at T with the sampler's defaults (top-k 40, "
                    "top-p 0.95, min-p 0.05); 0 (default): greedy")
    sp.add_argument("--top-k", type=int, metavar="K", help="bench profile, bench server: the sampled streams' top-k "
                    "(0 = off) in the default's place")
    sp.add_argument("--top-p", type=float, metavar="P", help="bench profile, bench server: their top-p (1.0 = off)")
    sp.add_argument("--min-p", type=float, metavar="P", help="bench profile, bench server: their min-p (0 = off)")
    sp.add_argument("--paths", default=None, metavar="NAME,NAME,...",
                    help="bench paths: the kernel paths to alternate (default: every self-tested one but portable)")
    sp.add_argument("--k-ahead", default=None, metavar="N1,N2,...",
                    help="bench paths: each path at each of these prefetch distances of the K-quants' decode kernels "
                    "(super-blocks, 0..64; 0: none), alternated")
    sp.add_argument("--prefetch-hints", default=None, metavar="t0,nta",
                    help="bench paths: each path at each of these hints of the weights' software prefetch (t0: into "
                    "every cache level, the default; nta: non-temporal), alternated")
    sp.add_argument("--items", type=int, default=64,
                    help="bench batch: prompts run as one `tracelm batch` and as separate `tracelm run` calls")
    sp.add_argument("--actors", type=int, default=2, help="bench batch: the Ray engine's actors")
    sp.add_argument("--draft-tokens", type=int, default=15,
                    help="bench speculative: most tokens guessed per pass (prompt lookup)")
    sp.add_argument("--input-file", metavar="FILE", help="bench tokenizer: the text to encode (default: English prose)")
    sp.add_argument("--model", default="smollm2-135m-instruct",
                    help="registry name or model path; or synth:NAME[@SEED][?layers=N], a registry model's family at "
                    "a published size (synth:qwen2.5-7b, synth:gemma3-4b, ...: `tracelm models list`) with random "
                    "weights, written once into TRACELM_HOME/synth: speed without the download (docs/performance.md)")
    sp.add_argument("--prompt-tokens", type=int, default=256)
    sp.add_argument("--decode-tokens", type=int, default=128)
    sp.add_argument("--context", type=int, default=1024)
    sp.add_argument("--threads", type=int, default=0)
    sp.add_argument("--compute", choices=("kernels", "reference"), default="kernels",
                    help="kernels: the compiled kernels on the file's blocks; reference: numpy on f32 weights")
    sp.add_argument("--activations", choices=("int16", "int8"), default="int16",
                    help="compute kernels: activations meet quantized weights as two int8 blocks (hi + lo, ~15 "
                    "bits) or one (llama.cpp's precision, half the integer work)")
    sp.add_argument("--weights", choices=("resident", "streamed"), default="resident",
                    help="streamed: weights stay quantized in the GGUF, a block dequantized at a time; reports "
                    "peak RSS against file + one block f32 + KV cache + 150 MB, and logits against resident")
    sp.add_argument("--kv-cache", choices=KV_CACHE_DTYPES, default="f16",
                    help="the model bench and --positions: what the Cache holds keys and values in (run config's "
                    "kv_cache)")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--positions", metavar="P1,P2,...",
                    help="instead: decode ms/token at each position (32 steps each, interleaved; ratios to the "
                    "first) and prefill tok/s of a 2,048-token prompt")
    sp.add_argument("--trace-overhead", action="store_true",
                    help="instead: decode tok/s untraced vs trace levels summary and digest, interleaved")
    sp.add_argument("--grammar", choices=("json", "schema"),
                    help="instead: decode tok/s plain vs constrained (json: any JSON object; schema: a JSON schema), "
                    "sampled, and the grammar stage's ms per token and share of decode time")
    sp.add_argument("--repeats", type=int, help="--trace-overhead: runs of the lock-step decode (default 7; the "
                    "overheads are the runs' median); --grammar: plain and constrained runs; --compare: prefills timed "
                    "per engine and round (the best counts); bench paths: rounds (default 5); default 3")
    _add_compare_options(sp)
    sp.set_defaults(fn=cmd_bench)


def _add_compare_options(sp: Any) -> None:
    """`bench --compare`'s options: tracelm beside llama.cpp and transformers."""
    sp.add_argument("--compare", action="store_true",
                    help="instead: tracelm, llama-cpp-python (flash attention off and on) and transformers (each "
                    "when installed) on the same GGUF, prompt ids and threads, each loaded once in its own process, "
                    "taking turns in every one of --rounds; prints their rates' medians (min-max), peak RSS, ratios "
                    "and greedy agreement; exits 1 when the greedy tokens disagree")
    sp.add_argument("--rounds", type=int, default=5,
                    help="--compare: rounds; in each every engine prefills in turn --repeats times (after one "
                    "untimed), then decodes in turns of --turn-steps steps (default 5)")
    sp.add_argument("--turn-steps", type=int, default=8, metavar="N",
                    help="--compare: greedy decode steps an engine takes in a turn before the next engine's "
                    "(default 8)")
    sp.add_argument("--engines", default="tracelm,llama.cpp,transformers", metavar="NAME,NAME,...",
                    help="--compare: the engines to run, tracelm first (default: %(default)s, each when installed)")
    sp.add_argument("--agree-tokens", type=int, default=32, metavar="K",
                    help="--compare: every engine's first K greedy tokens must be tracelm's, in every round "
                    "(default 32)")
    sp.add_argument("--allow-disagreement", action="store_true",
                    help="--compare: report a greedy disagreement but exit 0")
    sp.add_argument("--llama-bench", metavar="PATH",
                    help="--compare: also run llama.cpp's own llama-bench at PATH in every round (-p N -n N -t N "
                    "-fa 0,1 -r 1 -o json), its figures and ratios in the same report")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except TracelmError as e:
        print(f"tracelm: error: {e}{_positional_hint(args, e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
