"""The demo's seeded workload and its dependency-free PNG writer."""

from __future__ import annotations

import struct
import zlib

import pytest

from hicache.demo.png import Canvas, Series, line_chart
from hicache.demo.workload import Session, WorkloadSpec, make_workload


def test_workload_is_a_function_of_its_seed() -> None:
    """The same seed gives the same conversations; another seed gives others."""
    spec = WorkloadSpec(users=4, turns=3, seed=7)
    assert make_workload(spec) == make_workload(spec)
    assert make_workload(spec) != make_workload(WorkloadSpec(users=4, turns=3, seed=8))
    workload = make_workload(spec)
    assert workload.num_requests == 12
    assert {c.system_prompt for c in workload.conversations} == {0, 1, 2}
    for conv in workload.conversations:
        assert all(48 <= len(t) <= 160 for t in conv.turn_tokens)


def test_session_history_grows_by_prompt_and_reply() -> None:
    """Each turn's prompt extends the previous prompt and reply, so conversations share their prefix."""
    workload = make_workload(WorkloadSpec(users=1, turns=2, seed=1))
    session = Session(workload, workload.conversations[0])
    first = session.next_prompt()
    assert first[: workload.spec.system_prompt_tokens].tolist() == list(workload.system_prompts[0])
    session.record_reply(first, [1, 2, 3])
    second = session.next_prompt()
    assert second[: first.numel() + 3].tolist() == [*first.tolist(), 1, 2, 3]
    session.record_reply(second, [4])
    assert session.done
    with pytest.raises(ValueError, match="already served"):
        session.next_prompt()


def test_workload_spec_names_a_bad_argument() -> None:
    with pytest.raises(ValueError, match="users"):
        WorkloadSpec(users=0)
    with pytest.raises(ValueError, match="user_tokens"):
        WorkloadSpec(user_tokens=(10, 5))


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Parse an 8-bit RGB PNG written with filter 0 into its rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        if kind == b"IHDR":
            width, height = struct.unpack(">II", body[:8])
            assert body[8:10] == b"\x08\x02"
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    rows = [raw[r * stride + 1 : (r + 1) * stride] for r in range(height)]
    assert all(raw[r * stride] == 0 for r in range(height))
    return width, height, rows


def test_canvas_writes_a_valid_png_with_the_drawn_pixels() -> None:
    """A line drawn on the canvas shows up at the expected pixels of the decoded PNG."""
    canvas = Canvas(20, 10)
    canvas.line(0, 5, 19, 5, (255, 0, 0))
    width, height, rows = decode_png(canvas.to_png())
    assert (width, height) == (20, 10)
    assert rows[5][0:3] == b"\xff\x00\x00"
    assert rows[5][57:60] == b"\xff\x00\x00"
    assert rows[0][0:3] == b"\xff\xff\xff"


def test_line_chart_draws_each_series_in_its_colour() -> None:
    canvas = Canvas(300, 200)
    line_chart(
        canvas,
        (50, 30, 280, 170),
        [Series("up", [(0, 0), (10, 1)], (0, 0, 255)), Series("flat", [(0, 0.5), (10, 0.5)], (0, 160, 0))],
        title="test",
    )
    colours = {canvas.get(x, y) for x in range(300) for y in range(200)}
    assert (0, 0, 255) in colours
    assert (0, 160, 0) in colours
