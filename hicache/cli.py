"""The `hicache` command: `demo` (serve a seeded model through the cache and verify it), `inspect`, `bench`.

Exit status: 0 on success, 1 when a demo request's output differs from recompute (or a bench script
fails), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `hicache` command."""
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="serve a seeded small Llama to simulated users through a HiCache, verify every output",
        description="Serve a seeded multi-user chat workload through a HiCache (device, host and storage "
        "tiers), serve it again with full recompute, and check every request: restored K/V bitwise, "
        "logits bitwise against the same split in memory, and within 1e-4 of recompute.",
    )
    demo.add_argument(
        "--backend",
        metavar="URL",
        help="storage URL: file:///dir, memory://name, s3://bucket/prefix, valkey://host:port,.../prefix, "
        "mooncake://master:port/prefix?metadata=... (default: the file backend in a temporary directory)",
    )
    demo.add_argument(
        "--users", type=int, default=None, help="concurrent simulated users (default 8; 4 with --tp)"
    )
    demo.add_argument("--turns", type=int, default=None, help="turns per user (default 6; 3 with --tp)")
    demo.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    demo.add_argument(
        "--system-prompts",
        type=int,
        default=None,
        help="distinct system prompts shared by the users (default 3; with --model hybrid one per user)",
    )
    demo.add_argument(
        "--model",
        choices=["llama", "hybrid"],
        default="llama",
        help="llama: a small Llama (full attention); hybrid: a tiny LaraMini with full, sliding-window and "
        "linear-attention layers, cached with SlidingWindow and MambaState components (default llama)",
    )
    demo.add_argument(
        "--device-pages",
        type=int,
        default=None,
        help="pages in the device pool (default 160; 384 with --model hybrid; 24 per rank with --tp)",
    )
    demo.add_argument(
        "--host-pages",
        type=int,
        default=None,
        help="pages in the host pool (default 224; 640 with --model hybrid; 32 per rank with --tp)",
    )
    demo.add_argument(
        "--write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default="write_through",
        help="when device pages are backed up to host (default write_through)",
    )
    demo.add_argument(
        "--lockstep",
        action="store_true",
        help="serve one request at a time and let the cache settle in between: the same hits on every run",
    )
    demo.add_argument(
        "--refill-policy",
        choices=["drop", "backup_then_attach"],
        default="drop",
        help="a storage refill below a prefix not backed up yet: drop it, or back the prefix up and attach "
        "it (refill_under_unbacked; default drop)",
    )
    demo.add_argument(
        "--scenario",
        choices=["chat", "handoff"],
        default="chat",
        help="chat: users served by this instance only; handoff: users arrive from another instance "
        "sharing the storage, so storage hits hang below prefixes computed here and refills drop or are "
        "rescued (--refill-policy); Llama only, always in lockstep (default chat)",
    )
    demo.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallelism: serve with N gloo ranks on CPU, each caching its slice of the KV heads "
        "(1, 2 or 4; see hicache.demo.tp)",
    )
    demo.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    demo.add_argument("--plot", metavar="PATH", help="write a PNG of hit rate and TTFT over time")
    demo.add_argument("--snapshot", metavar="PATH", help="write a JSON snapshot for `hicache inspect`")
    demo.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus text on 127.0.0.1:PORT while running",
    )

    inspect = sub.add_parser(
        "inspect", help="show pool occupancy, tree size and top prefixes of a demo snapshot"
    )
    inspect.add_argument("snapshot", metavar="PATH", help="a file written by `hicache demo --snapshot PATH`")
    inspect.add_argument("--json", action="store_true", help="print the snapshot's state as JSON")
    inspect.add_argument(
        "--top", type=int, default=20, metavar="N", help="prefix rows to show (default 20; the total is said)"
    )

    bench = sub.add_parser("bench", help="run the benchmark scripts in bench/")
    bench.add_argument("names", nargs="*", help="scripts to run, e.g. bench_tree (default: all)")
    bench.add_argument("--dir", default=None, help="the bench directory (default: ./bench or the repo's)")
    bench.add_argument("--list", action="store_true", help="list the scripts and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `hicache` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "inspect":
        return _inspect(args)
    return _bench(args)


# ---------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hicache.demo.llama_serve import run_demo
    from hicache.demo.plot import save_plot
    from hicache.demo.records import DemoConfig, DemoResult
    from hicache.demo.report import render_summary, save_snapshot, summarize
    from hicache.policy import RefillPolicy, WritePolicy

    hybrid = args.model == "hybrid"
    if args.backend is not None:
        problem = _check_backend(args.backend)
        if problem is not None:
            print(f"hicache demo: --backend: {problem}", file=sys.stderr)
            return 2
    if args.scenario != "chat" and (hybrid or args.tp is not None):
        print(
            f"hicache demo: --scenario {args.scenario} runs with --model llama only, without --tp",
            file=sys.stderr,
        )
        return 2
    if args.tp is not None:
        return _demo_tp(args)
    default = DemoConfig()  # the sizes the demo runs with unless asked otherwise (as `_demo_tp` does)
    args.users = default.users if args.users is None else args.users
    args.turns = default.turns if args.turns is None else args.turns
    if args.system_prompts is None:
        # A hybrid prefix is reusable only where a state was stored (at the end of a request): a system
        # prompt shared by users ends at a split without one, so the hybrid run gives each user its own.
        args.system_prompts = args.users if hybrid else 3
    for name in ("users", "turns", "system_prompts"):
        if getattr(args, name) < 1:
            flag = name.replace("_", "-")
            print(f"hicache demo: --{flag} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    fields: dict[str, Any] = {
        "users": args.users,
        "turns": args.turns,
        "seed": args.seed,
        "backend_url": args.backend,
        "write_policy": WritePolicy(args.write_policy),
        "refill_policy": RefillPolicy(args.refill_policy),
        "metrics_port": args.metrics_port,
        "lockstep": args.lockstep,
        "scenario": args.scenario,
    }
    if args.device_pages is not None:
        fields["device_pages"] = args.device_pages
    if args.host_pages is not None:
        fields["host_pages"] = args.host_pages
    base = DemoConfig()
    if hybrid:
        from hicache.demo.hybrid_serve import HybridDemoConfig, hybrid_demo_config, run_hybrid_demo

        base = hybrid_demo_config()
    workload = dataclasses.replace(base.workload, system_prompts=args.system_prompts)
    config = dataclasses.replace(base, workload=workload, **fields)
    # With --json, stdout carries only the JSON; progress and messages go to stderr.
    err = Console(stderr=True)
    out = err if args.json else Console()
    if not out.is_terminal:
        out.width = max(out.width, 120)
    labels = {"cache": "with hicache", "recompute": "no cache (recompute)", "verify": "verifying"}
    with Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=args.json,
    ) as progress:
        loading = progress.add_task("loading model", total=None)
        tasks: dict[str, Any] = {}

        def on_progress(phase: str, done: int, total: int) -> None:
            if loading in progress.task_ids:
                progress.remove_task(loading)
            if phase not in tasks:
                tasks[phase] = progress.add_task(labels.get(phase, phase), total=total)
            progress.update(tasks[phase], completed=done, total=total)

        def announce(url: str) -> None:
            progress.console.print(f"serving metrics at {url}")

        result: DemoResult
        if hybrid:
            result = asyncio.run(run_hybrid_demo(HybridDemoConfig(config), on_progress, announce))
        else:
            result = asyncio.run(run_demo(config, on_progress, announce))
    summary = summarize(result)
    if args.plot:
        save_plot(result, args.plot)
    if args.snapshot:
        save_snapshot(result, summary, args.snapshot)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        out.print(render_summary(summary))
        wall = sum(result.wall_s.values())
        out.print(
            f"wall time {wall:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in result.wall_s.items()) + ")"
        )
        if args.plot:
            out.print(f"plot written to {args.plot}")
        if args.snapshot:
            out.print(f"snapshot written to {args.snapshot}; see `hicache inspect {args.snapshot}`")
    if summary["identical"] != summary["requests"]:
        bad = [r.request_id for r in result.records if not r.identical]
        err.print(
            f"[bold red]MISMATCH[/]: {len(bad)} request(s) differ from recompute: {', '.join(bad[:20])}"
        )
        return 1
    return 0


def _check_backend(url: str) -> str | None:
    """Why the demo's `--backend` URL cannot be opened (redacted), or None: checked by opening and closing
    it before the model loads, so a bad URL (credentials in it or its endpoint, a query a backend does
    not take) costs one line, not a model load and a traceback."""
    import asyncio

    from storage_backends.names import check_url_names
    from storage_backends.redact import redact_text, redact_url, secret_values
    from storage_backends.registry import open_backend

    if "://" not in url:
        return f"expected a URL, got {redact_url(url)!r}"
    try:
        check_url_names(url)
        backend = open_backend(url, namespace_digest=bytes(16))
        asyncio.run(backend.aclose())
    except (ValueError, TypeError, OSError) as exc:
        return redact_text(str(exc), secret_values(url))
    return None


_TP_REFUSED = (
    # (flag, attribute, the value the TP demo runs with): anything else is refused, never ignored.
    ("--model", "model", "llama"),
    ("--system-prompts", "system_prompts", None),
    ("--write-policy", "write_policy", "write_through"),
    ("--refill-policy", "refill_policy", "drop"),
    ("--plot", "plot", None),
    ("--snapshot", "snapshot", None),
    ("--metrics-port", "metrics_port", None),
)


def _demo_tp(args: argparse.Namespace) -> int:
    """`hicache demo --tp N`: honours --users, --turns, --seed, --device-pages, --host-pages, --backend
    (a file URL), --json and --lockstep (the TP demo always serves one request at a time); refuses every
    other flag the single-rank demo takes, naming it."""
    from hicache.demo.tp import TPDemoConfig, run_tp_demo

    for flag, name, runs_with in _TP_REFUSED:
        if getattr(args, name) != runs_with:
            shown = "" if runs_with is None else f" (it runs with {runs_with})"
            print(f"hicache demo: {flag} is not supported with --tp{shown}", file=sys.stderr)
            return 2
    default = TPDemoConfig()  # the sizes the TP demo runs with unless asked otherwise
    sizes: dict[str, int] = {
        "users": default.users if args.users is None else args.users,
        "turns": default.turns if args.turns is None else args.turns,
        "device_pages": default.device_pages if args.device_pages is None else args.device_pages,
        "host_pages": default.host_pages if args.host_pages is None else args.host_pages,
    }
    for name, value in sizes.items():
        if value < 1:
            print(f"hicache demo: --{name.replace('_', '-')} must be >= 1, got {value}", file=sys.stderr)
            return 2
    try:
        config = TPDemoConfig(
            tp=args.tp,
            seed=args.seed,
            users=sizes["users"],
            turns=sizes["turns"],
            device_pages=sizes["device_pages"],
            host_pages=sizes["host_pages"],
        )
    except ValueError as exc:
        print(f"hicache demo: --{exc}", file=sys.stderr)
        return 2
    result = run_tp_demo(config, None if args.backend is None else _file_root(args.backend))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(
            f"tp={result.tp}: {result.requests} requests, {result.saved_tokens} of {result.prompt_tokens} "
            f"prompt tokens served from the cache (hits by tier {result.hits}), {result.wall_s:.1f} s"
        )
    if not result.all_identical:
        for failure in result.failures[:20]:
            print(f"MISMATCH: {failure}", file=sys.stderr)
        return 1
    return 0


def _file_root(url: str) -> str:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.scheme != "file":
        raise SystemExit("hicache demo: --tp runs over the file backend only (--backend file:///dir)")
    return parsed.path


# ---------------------------------------------------------------------- inspect


_INT = (int,)
_POOL_FIELDS = ("used_pages", "capacity_pages", "page_size", "page_nbytes")
_TREE_FIELDS = ("nodes", "device_tokens", "evictable_device_tokens", "host_tokens", "evictable_host_tokens")
_PREFIX_FIELDS = ("hits", "nodes", "device_tokens", "host_tokens")
_SHOWN = ("pools", "tree", "top_prefixes", "summary")


def _inspect(args: argparse.Namespace) -> int:
    path = Path(args.snapshot)
    if args.top < 0:
        print(f"hicache inspect: --top must be >= 0, got {args.top}", file=sys.stderr)
        return 2
    try:
        data = json.loads(path.read_text())
    except RecursionError:
        print(f"hicache inspect: cannot read snapshot {str(path)!r}: JSON nested too deeply", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"hicache inspect: cannot read snapshot {str(path)!r}: {exc}", file=sys.stderr)
        return 2
    try:
        _check_snapshot(data)
        shown = _redact_shown({k: data.get(k) for k in _SHOWN})
    except (ValueError, RecursionError) as exc:  # a field missing or of another type, or nested too deeply
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        print(
            f"hicache inspect: {str(path)!r} is not a `hicache demo --snapshot` file: {reason}",
            file=sys.stderr,
        )
        return 2
    prefixes = shown["top_prefixes"] or []
    shown["top_prefixes"] = prefixes[: args.top]
    if args.json:
        print(json.dumps({**shown, "top_prefixes_total": len(prefixes)}, indent=2))
    else:
        _show_snapshot(shown, len(prefixes))
    return 0


def _check_snapshot(snapshot: object) -> None:
    """Refuse what `hicache inspect` would show wrongly: every field it reads, of the type it reads.

    Raises:
        ValueError: naming the first missing or mistyped field.
    """

    def need(value: object, where: str, kind: tuple[type, ...], what: str) -> Any:
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{where}: expected {what}, got {type(value).__name__}")
        return value

    def fields(value: object, where: str, names: Sequence[str]) -> dict[str, Any]:
        row: dict[str, Any] = need(value, where, (dict,), "an object")
        for name in names:
            if name not in row:
                raise ValueError(f"{where}.{name}: missing")
            need(row[name], f"{where}.{name}", _INT, "an int")
        return row

    data: dict[str, Any] = need(snapshot, "snapshot", (dict,), "an object")
    for key in ("pools", "tree"):
        if key not in data:
            raise ValueError(f"{key}: missing")
    pools: dict[str, Any] = need(data["pools"], "pools", (dict,), "an object")
    for tier in ("device", "host"):
        if pools.get(tier) is not None:
            pool = fields(pools[tier], f"pools.{tier}", _POOL_FIELDS)
            need(pool.get("device"), f"pools.{tier}.device", (str,), "a str")
    if pools.get("storage") is not None:
        storage: dict[str, Any] = need(pools["storage"], "pools.storage", (dict,), "an object")
        need(storage.get("url", ""), "pools.storage.url", (str,), "a str")
        need(storage.get("bytes_written", 0), "pools.storage.bytes_written", (int, float), "a number")
    fields(data["tree"], "tree", _TREE_FIELDS)
    rows = need(data.get("top_prefixes", []), "top_prefixes", (list,), "a list")
    for i, value in enumerate(rows):
        row = fields(value, f"top_prefixes[{i}]", _PREFIX_FIELDS)
        first = need(row.get("first_tokens"), f"top_prefixes[{i}].first_tokens", (list,), "a list")
        for token in first[:6]:
            need(token, f"top_prefixes[{i}].first_tokens", _INT, "a list of ints")
    summary = data.get("summary")
    if summary is not None:
        summary = fields(summary, "summary", ("requests", "identical"))
        need(summary.get("backend", ""), "summary.backend", (str,), "a str")


def _show_snapshot(data: dict[str, Any], total_prefixes: int) -> None:
    """Print a checked snapshot's pools, tree and top prefixes (those in `data`, of `total_prefixes`)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    pools = Table(title="pool occupancy per tier")
    for column in ("tier", "placement", "used pages", "capacity", "occupancy", "page size", "page bytes"):
        pools.add_column(column)
    for tier in ("device", "host"):
        p = data["pools"].get(tier)
        if p:
            pct = 100 * p["used_pages"] / max(1, p["capacity_pages"])
            pools.add_row(
                tier,
                str(p["device"]),
                str(p["used_pages"]),
                str(p["capacity_pages"]),
                f"{pct:.0f}%",
                str(p["page_size"]),
                str(p["page_nbytes"]),
            )
    storage = data["pools"].get("storage") or {}
    if storage:
        written = int(storage.get("bytes_written", 0))
        pools.add_row("storage", str(storage.get("url", "")), "-", "-", "-", "-", f"{written} written")
    console.print(pools)
    tree = data["tree"]
    console.print(
        f"tree: {tree['nodes']} nodes, {tree['device_tokens']} device tokens "
        f"({tree['evictable_device_tokens']} evictable), {tree['host_tokens']} host tokens "
        f"({tree['evictable_host_tokens']} evictable)"
    )
    rows = data["top_prefixes"]
    prefixes = Table(
        title=f"top prefixes (top-level branches, most hit first; {len(rows)} of {total_prefixes})"
    )
    for column in ("#", "first tokens", "hits", "nodes", "device tokens", "host tokens"):
        prefixes.add_column(column)
    for i, row in enumerate(rows, 1):
        first = " ".join(str(t) for t in row["first_tokens"][:6]) + " ..."
        prefixes.add_row(
            str(i),
            first,
            str(row["hits"]),
            str(row["nodes"]),
            str(row["device_tokens"]),
            str(row["host_tokens"]),
        )
    console.print(prefixes)
    if total_prefixes > len(rows):
        console.print(f"... {total_prefixes - len(rows)} more prefixes (--top N shows more)")
    summary = data.get("summary")
    if summary:
        console.print(
            f"run: {summary['requests']} requests, {summary['identical']}/{summary['requests']} identical to "
            f"recompute, backend {summary.get('backend', '')}"
        )


def _redact_shown(value: Any, name: object = None) -> Any:
    """`value` (what `inspect` prints) with every credential replaced by `***`, wherever it is: a
    secret-named field's value, and the user info and secret parameters of every URL in a string.

    Snapshots written by this version hold redacted URLs already; older or edited ones may not.
    """
    from storage_backends.redact import REDACTED, is_secret_name, redact_text

    if is_secret_name(name) and value not in (None, ""):
        return REDACTED
    if isinstance(value, dict):
        return {k: _redact_shown(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_shown(v) for v in value]
    if isinstance(value, str) and ("://" in value or "=" in value or "@" in value):
        return redact_text(value)
    return value


# ---------------------------------------------------------------------- bench


def _bench_dir(given: str | None) -> Path | None:
    candidates = (
        [Path(given)] if given else [Path.cwd() / "bench", Path(__file__).resolve().parents[1] / "bench"]
    )
    return next((c for c in candidates if c.is_dir()), None)


def _bench(args: argparse.Namespace) -> int:
    directory = _bench_dir(args.dir)
    if directory is None:
        print(
            "hicache bench: no bench/ directory found (run from the repository root or pass --dir)",
            file=sys.stderr,
        )
        return 2
    scripts = sorted(p for p in directory.glob("*.py") if not p.name.startswith("_"))
    if args.list:
        for script in scripts:
            print(script.stem)
        return 0
    if args.names:
        by_name = {p.stem: p for p in scripts} | {p.name: p for p in scripts}
        unknown = [n for n in args.names if n not in by_name]
        if unknown:
            known = ", ".join(p.stem for p in scripts) or "none"
            print(f"hicache bench: unknown script(s) {', '.join(unknown)}; known: {known}", file=sys.stderr)
            return 2
        scripts = [by_name[n] for n in args.names]
    if not scripts:
        print(f"hicache bench: no scripts in {directory}", file=sys.stderr)
        return 2
    status = 0
    for script in scripts:
        print(f"== {script.name}", flush=True)
        done = subprocess.run([sys.executable, str(script)], check=False)
        if done.returncode != 0:
            print(f"hicache bench: {script.name} exited with status {done.returncode}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
