"""What `launcher wait` prints without a terminal: one line per transition, then how to reach the gateway
(export and tunnel lines) or the failing log's tail."""

from __future__ import annotations

import io
import shlex
import subprocess

from launcher.api import WaitResult
from launcher.wait_display import (
    LiveView,
    PlainView,
    connection_hints,
    failure_lines,
    make_console,
    serving_lines,
)
from launcher.waiting import Outcome, Step


def test_plain_view_prints_one_line_per_transition_with_the_last_steps_time() -> None:
    lines: list[str] = []
    view = PlainView(lines.append)
    for name, at in (("PENDING", 100.0), ("RUNNING", 103.5), ("ray", 104.0), ("serving", 130.25)):
        view.on_phase(Step(name, at))
    assert lines == [
        "    0.0s  PENDING",
        "    3.5s  RUNNING  (PENDING 3.5 s)",
        "    4.0s  ray  (RUNNING 0.5 s)",
        "   30.2s  serving  (ray 26.2 s)",
    ]


def test_connection_hints_give_a_pasteable_export_and_a_tunnel_through_this_host() -> None:
    hints = connection_hints("http://10.1.2.3:23456", "/home/me/runs/my run/api_key", "login1.example.org")
    assert hints["tunnel"] == "ssh -N -L 23456:10.1.2.3:23456 login1.example.org"
    assert hints["laptop_base_url"] == "http://localhost:23456"
    # the export line is shell: run it and read the variables back
    script = hints["export"] + '; printf "%s\\n%s" "$TINKER_BASE_URL" "$TINKER_API_KEY"'
    words = shlex.split(hints["export"])
    assert words[0] == "export" and words[1] == "TINKER_BASE_URL=http://10.1.2.3:23456"
    assert "'/home/me/runs/my run/api_key'" in hints["export"]  # a path with a space stays one word
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
    assert out.stdout.splitlines()[0] == "http://10.1.2.3:23456"
    assert "No such file" in out.stderr  # it did try to read the key from that exact path


def _result(outcome: Outcome, **extra: object) -> WaitResult:
    steps = [Step("PENDING", 0.0, 2.0), Step("RUNNING", 2.0, 5.0), Step("ray", 5.0, 9.0)]
    return WaitResult("r-1", outcome, True, extra.pop("code", None), steps, 0.0, 9.0, **extra)  # type: ignore[arg-type]


def test_serving_lines_name_the_url_the_key_file_and_the_tunnel() -> None:
    result = _result(Outcome.SERVING, gateway_url="http://127.0.0.3:20001", api_key_file="/r/api_key")
    text = "\n".join(serving_lines(result, "login7"))
    assert "r-1: serving after 9.0 s" in text
    assert "gateway:      http://127.0.0.3:20001" in text and "API key file: /r/api_key" in text
    assert 'export TINKER_BASE_URL=http://127.0.0.3:20001 TINKER_API_KEY="$(cat /r/api_key)"' in text
    assert "ssh -N -L 20001:127.0.0.3:20001 login7" in text


def test_failure_lines_carry_the_failing_log_and_how_to_see_all_of_it() -> None:
    result = _result(Outcome.FAILED, code=2, failing_component="driver", log_tail=["boom", "exit 2"])
    assert failure_lines(result) == [
        "r-1: failed after 9.0 s, job exit code 2",
        "last 2 lines of the driver log (`launcher logs r-1 -c driver` for all of it):",
        "  boom",
        "  exit 2",
    ]
    timed_out = failure_lines(_result(Outcome.WAIT_TIMEOUT))
    assert "the job goes on" in timed_out[0] and timed_out[1] == "  (no log written)"


def test_result_json_has_each_step_with_its_time() -> None:
    data = _result(Outcome.FAILED, code=3).to_dict()
    assert data["steps"] == [
        {"name": "PENDING", "elapsed_s": 2.0},
        {"name": "RUNNING", "elapsed_s": 3.0},
        {"name": "ray", "elapsed_s": 4.0},
    ]
    assert (data["outcome"], data["exit_status"], data["elapsed_s"]) == ("failed", 3, 9.0)


def _live_text(clock_now: float, failed: bool = False) -> str:
    out = io.StringIO()
    console = make_console(out, force_terminal=True)
    view = LiveView(console, "r-1", clock=lambda: clock_now)
    view.on_phase(Step("PENDING", 0.0, 2.0))
    view.on_phase(Step("RUNNING", 2.0, 5.0 if failed else None))
    view.failed = failed
    console.print(view)
    return out.getvalue()


def test_no_color_turns_the_live_display_colourless(monkeypatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    coloured = _live_text(12.0)
    assert "RUNNING" in coloured and "10.0 s" in coloured and "2.0 s" in coloured
    assert "\x1b[32m" in coloured  # the green tick of a finished step
    monkeypatch.setenv("NO_COLOR", "1")
    plain = _live_text(12.0)
    assert "RUNNING" in plain and "10.0 s" in plain
    assert "\x1b[3" not in plain  # no foreground colour at all


def test_the_live_table_marks_the_step_a_failed_job_stopped_in() -> None:
    failed = _live_text(12.0, failed=True)
    assert failed.count("✓") == 1 and "✗" in failed and "3.0 s" in failed  # RUNNING ended after 3 s
    assert "✗" not in _live_text(12.0)
