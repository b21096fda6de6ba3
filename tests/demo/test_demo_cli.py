"""Smoke tests of the runnable surface: the examples and a small `hicache demo --json`, as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run a Python entry point from the repository root with the checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_minimal_loop_example_reuses_the_shared_prefix() -> None:
    """The second request of the minimal loop reuses the 16-token shared prefix from the device tier."""
    done = run("examples/minimal_loop.py")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("alice: 21 tokens, reused 0 ")
    assert lines[1] == "bob: 19 tokens, reused 16 {'device': 16, 'host': 0, 'storage': 0}"
    assert lines[2].startswith("<HiCache open")


def test_custom_backend_example_serves_a_restarted_cache_from_storage() -> None:
    """A fresh cache over the custom backend finds the first cache's pages there (32 tokens from storage)."""
    done = run("examples/custom_backend.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "first server:  {'device': 0, 'host': 0, 'storage': 0}",
        "backend holds 8 pages",
        "second server: {'device': 0, 'host': 0, 'storage': 32}",
    ]


@pytest.mark.slow
def test_small_demo_is_identical_to_recompute_with_hits_on_two_tiers(tmp_path: Path) -> None:
    """Two users sharing a system prompt, pools small enough to evict: every output matches recompute.

    `--lockstep` makes the tiers hit a function of the workload: served concurrently, whether a prefix was
    still on the device or already demoted to host shifted with the machine's load (a flaky test).
    """
    snapshot = tmp_path / "snap.json"
    plot = tmp_path / "plot.png"
    done = run(
        "-m", "hicache.cli", "demo", "--users", "2", "--turns", "3", "--json", "--system-prompts", "1",
        "--device-pages", "40", "--host-pages", "72", "--lockstep", "--snapshot", str(snapshot),
        "--plot", str(plot), "--metrics-port", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["requests"] == 6
    assert summary["identical"] == summary["requests"]
    assert summary["checks"]["kv_bitwise"] == 6
    assert summary["checks"]["max_recompute_logit_diff"] <= 1e-4
    assert summary["hit_tokens"]["device"] > 0
    assert summary["hit_tokens"]["host"] > 0
    assert summary["requests_with_hits"]["host"] >= 1
    assert summary["prefill_tokens_saved"] > 0
    assert summary["ttft_ms"]["cache"]["p50"] > 0
    assert summary["ttft_ms"]["no_cache"]["p50"] > 0
    assert summary["metrics_url"].startswith("http://127.0.0.1:")
    assert summary["bytes_moved"]["storage_written"] > 0  # read from hicache_storage_written_bytes_total
    image = imread(plot)
    assert image.shape[:2] == (800, 1200)
    assert float(image[:, :, :3].var()) > 0.01

    shown = run("-m", "hicache.cli", "inspect", str(snapshot), "--json")
    assert shown.returncode == 0, shown.stderr
    state = json.loads(shown.stdout)
    assert state["pools"]["device"]["capacity_pages"] == 40
    assert state["tree"]["nodes"] >= 1
    assert state["top_prefixes"]
    written = json.loads(snapshot.read_text())["metrics"]["hicache_storage_written_bytes_total"]
    assert written["samples"] == [{"labels": {}, "value": summary["bytes_moved"]["storage_written"]}]


def test_cli_rejects_bad_arguments_and_missing_snapshots(tmp_path: Path) -> None:
    assert run("-m", "hicache.cli", "demo", "--users", "0").returncode == 2
    missing = run("-m", "hicache.cli", "inspect", str(tmp_path / "nope.json"))
    assert missing.returncode == 2
    assert "cannot read snapshot" in missing.stderr


def test_inspect_refuses_a_snapshot_with_malformed_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file with the snapshot's keys but not their fields is refused with status 2, not a traceback."""
    from hicache.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pools": {"storage": {"url": 7}, "device": {}}, "tree": {}}))
    assert main(["inspect", str(bad)]) == 2
    assert "is not a `hicache demo --snapshot` file" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--model", "hybrid"], ["--tp", "2"]])
def test_the_handoff_scenario_is_refused_beside_hybrid_or_tp(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--scenario handoff` runs with the Llama model on one rank only: with `--model hybrid` or `--tp` it
    is refused with status 2, naming the scenario, before anything runs."""
    from hicache.cli import main

    assert main(["demo", "--scenario", "handoff", *extra]) == 2
    assert "--scenario handoff runs with --model llama only, without --tp" in capsys.readouterr().err


def test_the_pool_size_help_names_the_defaults_each_demo_runs_with() -> None:
    """`--device-pages` / `--host-pages` say what each demo runs with when they are not given."""
    from hicache.cli import build_parser
    from hicache.demo.hybrid_serve import hybrid_demo_config
    from hicache.demo.records import DemoConfig
    from hicache.demo.tp import TPDemoConfig

    demo = next(a for a in build_parser()._actions if a.dest == "command").choices["demo"]  # type: ignore[union-attr]
    helps = {a.dest: a.help for a in demo._actions}
    llama, hybrid, tp = DemoConfig(), hybrid_demo_config(), TPDemoConfig()
    for name in ("device_pages", "host_pages"):
        text = helps[name]
        assert f"default {getattr(llama, name)};" in text
        assert f"{getattr(hybrid, name)} with --model hybrid" in text
        assert f"{getattr(tp, name)} per rank with --tp" in text


def _snapshot(rows: int = 2, **changes: object) -> dict[str, object]:
    """A well-formed `hicache demo --snapshot` file's data with `rows` prefix rows."""
    pool = {
        "device": "cpu",
        "capacity_pages": 8,
        "used_pages": 2,
        "free_pages": 6,
        "page_size": 4,
        "page_nbytes": 64,
    }
    data: dict[str, object] = {
        "pools": {"device": pool, "host": pool, "storage": {"url": "file:///tmp/s", "bytes_written": 0}},
        "tree": {
            "nodes": 3,
            "device_tokens": 8,
            "evictable_device_tokens": 4,
            "host_tokens": 8,
            "evictable_host_tokens": 8,
        },
        "top_prefixes": [
            {"first_tokens": [i, 1, 2], "hits": 1, "nodes": 1, "device_tokens": 4, "host_tokens": 0}
            for i in range(rows)
        ],
        "summary": {"requests": 2, "identical": 2, "backend": "file:///tmp/s"},
    }
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tree": {"nodes": "3"}}, "tree.nodes"),
        ({"pools": {"device": {"used_pages": 1}}}, "pools.device.capacity_pages"),
        (
            {
                "top_prefixes": [
                    {"first_tokens": "abc", "hits": 1, "nodes": 1, "device_tokens": 0, "host_tokens": 0}
                ]
            },
            "top_prefixes[0].first_tokens",
        ),
        ({"summary": {"requests": None, "identical": 0}}, "summary.requests"),
        ({"top_prefixes": {"a": 1}}, "top_prefixes"),
    ],
    ids=["tree-str", "pool-missing", "prefix-tokens", "summary-null", "prefixes-dict"],
)
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "table"])
def test_inspect_refuses_malformed_snapshots_in_both_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], field: str, as_json: bool
) -> None:
    """Issue 22: `inspect --json` printed malformed snapshots and exited 0; both outputs check the same
    fields and exit 2 naming the first bad one."""
    from hicache.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_snapshot(**change)))
    assert main(["inspect", str(bad), *(["--json"] if as_json else [])]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"is not a `hicache demo --snapshot` file: {field}" in captured.err


def test_inspect_reports_deeply_nested_json_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hicache.cli import main

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    assert main(["inspect", str(deep), "--json"]) == 2
    assert "JSON nested too deeply" in capsys.readouterr().err


def test_inspect_shows_the_top_rows_of_a_snapshot_with_200000_prefixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every one of 200,000 rows was printed (62 s); the table and the JSON show `--top` rows (20 by
    default) and say how many there are."""
    from hicache.cli import main

    big = tmp_path / "big.json"
    big.write_text(json.dumps(_snapshot(rows=200_000)))
    assert main(["inspect", str(big), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["top_prefixes"]) == 20
    assert shown["top_prefixes_total"] == 200_000
    assert main(["inspect", str(big), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 of 200000" in out
    assert "199997 more prefixes" in out
    assert len(out.splitlines()) < 40


def test_inspect_redacts_every_url_an_older_or_edited_snapshot_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The storage URL of an older (or edited) snapshot was printed unredacted by `--json`: redaction is
    done on output, wherever a URL or a secret-named field is."""
    from hicache.cli import main

    url = "s3://AKIAUSER22:PWSECRET22@bucket/p?secret_access_key=QSECRET22&region=r"
    old = _snapshot(
        pools={"storage": {"url": url, "bytes_written": 1.0}},
        summary={
            "requests": 1,
            "identical": 1,
            "backend": url,
            "config": {"backend_url": url, "token": "TOK22"},
        },
    )
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    for flags in (["--json"], []):
        assert main(["inspect", str(path), *flags]) == 0
        out = capsys.readouterr().out
        for secret in ("AKIAUSER22", "PWSECRET22", "QSECRET22", "TOK22"):
            assert secret not in out
        assert "bucket" in out


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAUSER22:PWSECRET22@bucket/p",
        "s3://bucket/p?endpoint=http://AKIAUSER22:PWSECRET22@localhost:9000",
        "s3://bucket/p?endpoint=http://AKIAUSER22:PW/SECRET22@storage.example:9000",
        "file:///tmp/hicache-demo?durable=1",
    ],
    ids=["user-info", "endpoint-user-info", "endpoint-slash-password", "file-query"],
)
def test_demo_refuses_a_bad_backend_url_before_loading_the_model(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend URL with credentials in it or its endpoint, or a file URL with a query, loaded the model
    first and then died with a traceback; it is refused with status 2 and one redacted line first."""
    import hicache.demo.llama_serve
    from hicache.cli import main

    def no_model(*args: object) -> None:
        raise AssertionError("the demo started before its backend URL was checked")

    monkeypatch.setattr(hicache.demo.llama_serve, "run_demo", no_model)
    assert main(["demo", "--backend", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache demo: --backend: ")
    assert len(err.splitlines()) == 1
    for secret in ("AKIAUSER22", "akiauser22", "PWSECRET22", "SECRET22"):
        assert secret not in err
