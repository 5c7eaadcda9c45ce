"""bench/profile_job.py (J1's host time beyond the engine's, on the CPU) runs, and --timeline accounts for every
engine step of both runs."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "profile_job.py"
LINE = re.compile(r"^(engine|job): (\d+) steps, the first at (\d+) ms; full batches from (\d+) to (\d+) ms, a step "
                  r"every ([\d.]+) ms there \(median ([\d.]+)\), (\d+) gaps of over 1 ms between steps \((\d+) ms\); "
                  r"(\d+) sequences a step; (-?\d+) ms after", re.M)


def test_profile_job_timeline():
    out = subprocess.run([sys.executable, str(SCRIPT), "--rows", "48", "--max-tokens", "6", "--max-num-seqs", "16",
                          "--device-us", "50", "--prepare-workers", "0", "--timeline"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = {m.group(1): m.groups()[1:] for m in LINE.finditer(out.stdout)}
    assert set(lines) == {"engine", "job"}, out.stdout
    for name, (steps, first, full_from, full_to, mean, median, gaps, gap_ms, seqs, after) in lines.items():
        # 48 rows of 6 tokens at 16 a step: at least 48 * 6 / 16 = 18 steps, and no step runs more than 16
        assert int(steps) >= 18 and 1 <= int(seqs) <= 16, (name, out.stdout)
        assert int(first) <= int(full_from) <= int(full_to) and float(mean) > 0 and float(median) > 0
        assert int(after) >= 0 and (int(gaps) > 0 or int(gap_ms) == 0)
    assert "job, text rows:" in out.stdout and "phases of the job path" in out.stdout


def test_profile_job_on_a_backend_runs_the_model():
    """--backend runs random weights through the engine and the job alike (on a GPU: J1's own profile); --device-us,
    the stand-in for a device, is refused beside it in one usage line."""
    argv = [sys.executable, str(SCRIPT), "--rows", "8", "--max-tokens", "3", "--max-num-seqs", "4",
            "--prepare-workers", "0", "--timeline", "--backend", "numpy", "--dummy-weights", "tiny"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = {m.group(1): m.groups()[1:] for m in LINE.finditer(out.stdout)}
    assert set(lines) == {"engine", "job"} and "(24 tokens)" in out.stdout, out.stdout
    refused = subprocess.run(argv + ["--device-us", "5"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--device-us stands in for a device" in refused.stderr.splitlines()[-1]
    unknown = subprocess.run(argv[:-1] + ["nope"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 1 and unknown.stderr.splitlines() == [
        unknown.stderr.splitlines()[-1]] and "nope" in unknown.stderr
