"""bench/profile_host.py's pure parts (summaries, the GPU gaps from event times, the phase wrapping and the event
timeline on a made-up clock) and a run of it on the numpy backend: the script imports no pycuda until it runs on
the cuda backend."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "profile_host.py"


@pytest.fixture(scope="module")
def profile_host():
    return load_script(SCRIPT, "profile_host")


def test_device_times_gaps_run_from_one_steps_end_to_the_next_steps_start(profile_host):
    # step 1 queued no GPU work: the gap is from step 0's end to step 2's start
    times = profile_host.device_times([0.0, None, 5.0, 9.0], [3.0, None, 8.0, 10.0])
    assert times["gpu_ms"] == [3.0, 3.0, 1.0]
    assert times["gaps_ms"] == [2.0, 1.0]
    assert times["span_ms"] == 10.0
    assert times["idle_share"] == pytest.approx(0.3)
    empty = profile_host.device_times([], [])
    assert empty == {"gpu_ms": [], "gaps_ms": [], "span_ms": 0.0, "idle_share": 0.0}


def test_summary_and_phase_table(profile_host):
    s = profile_host.summary([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    assert s["n"] == 10 and s["median"] == 5.5 and s["p90"] == pytest.approx(9.1) and s["mean"] == 5.5
    assert profile_host.summary([])["median"] is None
    # a phase a step did not enter counts 0 there; one no step entered is left out
    table = profile_host.phase_table([{"a": 0.001}, {"a": 0.003, "b": 0.002}], ["a", "b", "c"])
    assert table["a"]["median"] == pytest.approx(2.0) and table["b"]["median"] == pytest.approx(1.0)
    assert "c" not in table


def test_phases_wrap_time_and_undo(profile_host):
    class Owner:
        def work(self, x):
            return x + 1

    phases = profile_host.Phases()
    owner, other = Owner(), Owner()
    assert phases.wrap(owner, "work", "work")
    assert not phases.wrap(owner, "absent", "absent")
    assert phases.wrap(Owner, "work", "class work")  # a class's method: every instance's
    assert owner.work(1) == 2 and other.work(1) == 2
    assert phases.current["work"] > 0 and phases.current["class work"] > 0
    phases.current["engine step"] = 1.0
    phases.current["schedule"] = 0.25
    phases.kind = "decode"
    phases.end_step()
    assert phases.kinds == ["decode"] and phases.steps[0][profile_host.ENGINE_OTHER] == pytest.approx(0.75)
    assert not phases.current and phases.kind is None
    phases.unwrap()
    assert "work" not in vars(owner) and Owner.work(owner, 1) == 2
    assert "wrapper" not in Owner.work.__qualname__


class FakeClock:
    """pycuda's Event and a stream on a clock the test moves: an event records the clock's time."""

    def __init__(self):
        self.now = 0.0
        clock = self

        class Event:
            def record(self, stream):
                self.at = clock.now

            def time_since(self, other):
                return self.at - other.at

        self.cuda = SimpleNamespace(Event=Event)
        self.stream = SimpleNamespace(synchronize=lambda: None)


def test_timeline_marks_first_launch_replay_and_end(profile_host):
    clock = FakeClock()
    timeline = profile_host.Timeline(clock.cuda, clock.stream)
    timeline.begin()  # before any step: nothing to mark
    for start in (10.0, 14.0):
        timeline.submitted()
        clock.now = start
        timeline.begin()
        clock.now = start + 1
        timeline.begin()  # a later launch of the same step does not move its start
        timeline.capturing = True
        timeline.end()  # a capture records nothing
        timeline.capturing = False
        clock.now = start + 3
        timeline.end()
    timeline.submitted()  # a step that launched nothing
    times = timeline.results()
    assert times["gpu_ms"] == [3.0, 3.0] and times["gaps_ms"] == [1.0] and times["span_ms"] == 7.0
    assert times["replays_ms"] == []


def test_timed_event_answers_for_the_event_it_wraps(profile_host):
    """The runner asks its output event both to wait (timed as a phase) and whether the device is still busy
    (QueuedStep.done, for the job's admission): the wrapper answers both as the event does."""
    state = {"done": False, "waits": 0}
    event = SimpleNamespace(query=lambda: state["done"], synchronize=lambda: state.update(waits=state["waits"] + 1),
                            record=lambda stream: None)
    phases = profile_host.Phases()
    timed = profile_host.TimedEvent(event, phases, None)
    assert timed.query() is False
    state["done"] = True
    assert timed.query() is True and "wait for sampled ids" not in phases.current
    timed.synchronize()
    assert state["waits"] == 1 and phases.current["wait for sampled ids"] > 0


def test_runs_on_the_numpy_backend(profile_host, tmp_path, capsys):
    out = tmp_path / "host.json"
    results = profile_host.main(["--backend", "numpy", "--dummy-weights", "tiny", "--batch", "3", "--steps", "4",
                                 "--warmup", "1", "--prompt-len", "8", "--workloads", "W3,J1", "--scale", "0.02",
                                 "--j1-rows", "3", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    steady = results["batches"]["3"]
    assert steady["decode"]["steps"] == 4 and "gpu" not in steady
    host = steady["decode"]["host_ms"]
    assert {"engine step", "schedule", "prepare", "submit", "output processing"} <= set(host)
    assert host["engine step"]["median"] >= host["submit"]["median"]
    assert "stage decode" in steady["phases_not_found"]  # the cuda backend's
    j1 = results["workloads"]["J1"]
    assert j1["requests"] == 3 and j1["prefill"]["steps"] >= 1 and j1["decode"]["steps"] >= 1
    assert "== workload W3" in capsys.readouterr().out


def test_w6_times_the_masks_phases_on_the_numpy_backend(profile_host):
    """W6 runs its rows under the JSON schema: the masks' phases are timed (inside the engine step, beside its other
    parts), and the output tokens are those generated (rows end where their JSON does)."""
    pytest.importorskip("llguidance")
    results = profile_host.main(["--backend", "numpy", "--dummy-weights", "tiny", "--batch", "", "--workloads", "W6",
                                 "--scale", "0.02"])
    w6 = results["workloads"]["W6"]
    host = w6["decode"]["host_ms"]
    assert {"masks: rows", "masks: start worker", "masks: wait for worker"} <= set(host)
    parts = sum(host[name]["mean"] for name in profile_host.ENGINE_PARTS if name in host)
    assert parts <= host["engine step"]["mean"] * 1.001 + 1e-6, "the parts are inside the step, none twice"
    assert 0 < w6["output_tokens"] <= w6["requests"] * 13  # 256 x 0.02 tokens at most each


def test_mixed_gives_every_fourth_row_the_stop_string_logprobs_and_penalties(profile_host, monkeypatch):
    from tinyvllm.benchmark import MIXED_SAMPLING
    seen = []
    real = profile_host.fill

    def spy(llm, batch, prompt_len, max_tokens, mixed=False):
        real(llm, batch, prompt_len, max_tokens, mixed)
        seen.extend(s.params for s in llm.llm_engine.scheduler.running)

    monkeypatch.setattr(profile_host, "fill", spy)
    results = profile_host.main(["--backend", "numpy", "--dummy-weights", "tiny", "--batch", "8", "--steps", "2",
                                 "--warmup", "0", "--prompt-len", "4", "--mixed"])
    assert results["batches"]["8"]["mixed"] is True and len(seen) == 8
    mixed = [p for p in seen if p.logprobs == MIXED_SAMPLING["logprobs"]]
    assert len(mixed) == 2 and all(p.stop == MIXED_SAMPLING["stop"] and p.presence_penalty == 0.5 for p in mixed)


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "W9"], "unknown W9"), (["--batch", "x"], "comma-separated"),
    (["--batch", "", "--workloads", ""], "nothing to run"), (["--steps", "0"], "--steps 0: at least 1"),
    (["--scale", "2"], "--scale in (0, 1]")])
def test_bad_arguments_are_one_line_usage_errors(profile_host, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        profile_host.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
