"""The `specdec` command line: up, generate, info.

More subcommands come from the `specdec.commands` entry points (pyproject.toml): the
measurement lab adds bench, study and tune, without the core ever importing it."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time

from importlib.metadata import entry_points

from specdec.config import SpecdecConfig
from specdec.devices import resolve_draft_engine

COMMAND_PLUGINS = "specdec.commands"  # entry points: callables that add subparsers
TOKEN_ENV = "SPECDEC_TOKEN"  # the default of --token, so that the token need not be on the command line


# -- specdec up ----------------------------------------------------------------------------
def cmd_up(a) -> int:
    from specdec.launcher import Stack

    cfg = SpecdecConfig.load(a.config)
    cfg.orchestrator.port = a.port or cfg.orchestrator.port
    cfg.target.port = a.target_port or cfg.target.port
    cfg.draft.port = a.draft_port or cfg.draft.port
    if a.target_model:
        cfg.target.model = a.target_model
    if a.target_dtype:
        cfg.target.dtype = a.target_dtype
    if a.draft_model:
        cfg.draft.model = a.draft_model
    if a.draft_engine:
        cfg.draft.engine = a.draft_engine
    if a.host:
        for s in (cfg.target, cfg.draft, cfg.orchestrator):
            s.host = a.host
    stack = Stack(cfg, a.log_dir, with_draft=not a.no_draft)
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    draft_engine = resolve_draft_engine(cfg.draft.engine, cfg.draft.device)
    print(f"starting target ({cfg.target.model}), draft ({draft_engine}: {cfg.draft.model}) and orchestrator; "
          f"logs in {stack.dir}", flush=True)
    t0 = time.monotonic()
    stack.start()
    try:
        deadline = time.monotonic() + a.timeout
        waiting = set(stack.procs)
        from specdec.launcher import is_serving

        def healthy(s: str) -> bool:  # startup and the supervisor's "healthy again" use the same check
            return is_serving(stack.address(s))

        while waiting and not stop["flag"]:
            for s in list(waiting):
                if stack.procs[s].poll() is not None:
                    print(f"{s} service exited ({stack.procs[s].returncode}); its log:\n{stack.log(s)[-2000:]}",
                          file=sys.stderr)
                    return 1
                if healthy(s):
                    waiting.discard(s)
                    print(f"  {s:<12} healthy on {stack.address(s)} (pid {stack.procs[s].pid})", flush=True)
            if time.monotonic() > deadline:
                print(f"timed out waiting for {sorted(waiting)}", file=sys.stderr)
                return 1
            time.sleep(0.3)
        if stop["flag"]:
            return 0
        if stack.with_draft:
            _wait_for_drafting(cfg, stack.address("orchestrator"), min(10.0, max(0.0, deadline - time.monotonic())))
        print(f"specdec is up in {time.monotonic() - t0:.0f}s: orchestrator at {stack.address('orchestrator')} "
              f"(try: specdec generate 'Hello' --address {stack.address('orchestrator')}). Ctrl-C stops all three.",
              flush=True)
        # supervise: a service that exits is restarted in place with backoff (specdec/supervisor.py);
        # the loop ends on SIGINT/SIGTERM, so nothing is restarted once we are stopping
        from specdec.supervisor import Supervisor

        supervisor = Supervisor(stack, healthy, log=lambda line: print(line, flush=True))
        while not stop["flag"]:
            supervisor.tick()
            time.sleep(0.5)
        return 0
    finally:
        print("stopping services", flush=True)
        stack.stop()


def _wait_for_drafting(cfg: SpecdecConfig, address: str, within_s: float) -> None:
    """Once all three answer: wait until the orchestrator has probed the draft as available (its
    monitor probes every probe_interval_s), so that "up" means requests draft. Says why when the
    draft is not used. Skipped when the orchestrator asks for TLS or a token."""
    if cfg.orchestrator.tls_cert_file or cfg.orchestrator.auth_token_file:
        return
    import grpc

    from specdec.client import Client

    deadline = time.monotonic() + within_s
    info: dict = {}
    with Client(address, timeout=5) as c:
        while time.monotonic() < deadline:
            try:
                info = c.info()
            except grpc.RpcError:
                info = {}
            if info.get("draft_available"):
                print(f"  {'draft':<12} drafting for the orchestrator", flush=True)
                return
            time.sleep(0.1)
    print(f"  the orchestrator does not use the draft yet: {info.get('draft_problem') or 'not probed as available'}",
          flush=True)


# -- specdec generate ----------------------------------------------------------------------
def cmd_generate(a) -> int:
    import grpc

    from specdec.client import ResultCollector
    from specdec.errors import SpecdecError

    kw = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
              stop=a.stop or (), ignore_eos=a.ignore_eos, k=a.k or 0, mode=a.mode,
              draft_temperature=a.draft_temperature, draft_top_k=a.draft_top_k, draft_top_p=a.draft_top_p,
              adaptive_k=a.adaptive_k)
    if a.raw:
        kw["text"] = a.prompt
        prompt = None
    else:
        prompt = a.prompt
    col = ResultCollector()
    try:
        with connect(a) as c:
            for chunk in c.generate(prompt, **kw):
                col.add(chunk)
                if not a.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
    except (grpc.RpcError, SpecdecError) as e:
        return report_error(e, a.flags)
    res = col.result()
    if a.json:
        print(json.dumps(res.to_json() if a.rounds else {k: v for k, v in res.to_json().items() if k != "rounds"}))
    else:
        s = res.stats
        print(f"\n[{s.get('completion_tokens', 0)} tokens, {s.get('tokens_per_s', 0):.1f} tok/s, "
              f"ttft {s.get('ttft_ms', 0):.0f} ms, acceptance {s.get('acceptance_rate', 0):.2f}, "
              f"mode {s.get('mode')}, k {s.get('k')}, finish {s.get('finish_reason')}]", file=sys.stderr)
    return 0


def name_flag(message: str, flags: dict[str, str]) -> str:
    """Errors name the parameter first ('max_tokens must be > 0'); a CLI user also gets its flag
    ('max_tokens (--max-tokens) must be > 0')."""
    m = re.match(r"[a-z_]+", message)
    if m and m.group(0) in flags:
        return f"{m.group(0)} ({flags[m.group(0)]}){message[m.end():]}"
    return message


def report_error(e: Exception, flags: dict[str, str]) -> int:
    """Print a failed call's status and message (a grpc.RpcError, or a SpecdecError such as an
    unreadable --ca-file raised before any call) to stderr; -> the exit status, 2."""
    from specdec.errors import SpecdecError

    code, message = (e.status, e.message) if isinstance(e, SpecdecError) else (e.code().name, e.details() or "")
    print(f"error: {code}: {name_flag(message, flags)}", file=sys.stderr)
    return 2


def cmd_info(a) -> int:
    import grpc

    from specdec.errors import SpecdecError

    try:
        with connect(a) as c:
            print(json.dumps(c.info(), indent=2))
    except (grpc.RpcError, SpecdecError) as e:
        return report_error(e, a.flags)
    return 0


def connect(a):
    """The SDK client `generate` and `info` use, from their connection flags."""
    from specdec.client import Client

    return Client(a.address, timeout=a.timeout, ca_file=a.ca_file, tls=a.tls, cert_file=a.cert_file,
                  key_file=a.key_file, token=a.token)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """--address and how to reach it: TLS (--ca-file or --tls; --cert-file and --key-file when the
    server requires a client certificate) and the bearer token (--token, default $SPECDEC_TOKEN)."""
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--ca-file", help="TLS: the CA certificate (PEM) that signed the server's certificate")
    p.add_argument("--tls", action="store_true", help="TLS, trusting the system's root certificates")
    p.add_argument("--cert-file", help="mTLS: this client's certificate chain (PEM)")
    p.add_argument("--key-file", help="mTLS: this client's private key (PEM)")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"bearer token sent as 'authorization: Bearer <token>' (default: ${TOKEN_ENV}, "
                        "which keeps it out of the process list)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="speculative decoding over gRPC")
    sub = ap.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start target, draft and orchestrator as local processes")
    up.add_argument("--config", help="TOML config file")
    up.add_argument("--port", type=int, help="orchestrator (public) port, default 50051")
    up.add_argument("--target-port", type=int, help="default 50052")
    up.add_argument("--draft-port", type=int, help="default 50053")
    up.add_argument("--target-model", help="packaged name, .gguf file or HF directory")
    up.add_argument("--target-dtype", choices=["float32", "bfloat16", "float16", "int4"],
                    help="torch target precision (int4: 4-bit weights; an INT4 checkpoint's own codes)")
    up.add_argument("--draft-model", help="packaged name, .gguf file or HF directory")
    up.add_argument("--draft-engine", choices=["auto", "llamacpp", "torch", "ngram"],
                    help="auto (the default): torch on a GPU or an AVX-512 CPU, else llamacpp")
    up.add_argument("--no-draft", action="store_true", help="start without a draft service (target-only)")
    up.add_argument("--host", help="listen address for all three (default 127.0.0.1)")
    up.add_argument("--log-dir", help="where the service logs go (default: a temp dir)")
    up.add_argument("--timeout", type=float, default=900, help="seconds to wait for health")
    up.set_defaults(fn=cmd_up)

    g = sub.add_parser("generate", help="generate from a prompt (sent as one user chat message)")
    g.add_argument("prompt")
    add_connection_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--draft-temperature", type=float)
    g.add_argument("--draft-top-k", type=int)
    g.add_argument("--draft-top-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--k", type=int, help="draft length (default: the server's)")
    g.add_argument("--mode", choices=["pipelined", "sequential", "target-only"])
    g.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each round's k (at most --k) from measured costs and acceptance "
                        "(default: the server's orchestrator.adaptive_k)")
    g.add_argument("--stop", action="append", help="stop sequence (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (prompt_token_ids, token_ids, text, stats)")
    g.add_argument("--rounds", action="store_true", help="with --json: include per-round statistics")
    g.add_argument("--timeout", type=float, default=600)
    g.set_defaults(fn=cmd_generate, flags={x.dest: x.option_strings[-1] for x in g._actions if x.option_strings})

    i = sub.add_parser("info", help="show the served models and defaults")
    add_connection_args(i)
    i.add_argument("--timeout", type=float, default=30)
    i.set_defaults(fn=cmd_info, flags={x.dest: x.option_strings[-1] for x in i._actions if x.option_strings})

    for ep in entry_points(group=COMMAND_PLUGINS):  # the lab's bench, study and tune
        ep.load()(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return a.fn(a) or 0


if __name__ == "__main__":
    sys.exit(main())
