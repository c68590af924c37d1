"""`python -m torch_mpmd.schedules`, run as a user would, in a subprocess."""

import subprocess
import sys

import pytest

from torch_mpmd.schedules import Schedule, schedule_names

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "torch_mpmd.schedules", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def assert_one_line_error(out, *fragments):
    assert out.returncode == 2, out
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m torch_mpmd.schedules: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_show_prints_the_per_rank_table_and_metrics():
    out = cli("show", "1f1b", "--ranks", 4, "--microbatches", 8)
    assert out.returncode == 0, out.stderr
    for r in range(4):
        assert f"rank {r} | {r}F0" in out.stdout
    assert "makespan: 33\n" in out.stdout
    assert "bubble fraction per rank: 0.273 0.273 0.273 0.273" in out.stdout
    assert "peak activations per rank: 4 3 2 1\n" in out.stdout
    assert "messages: 48" in out.stdout


def test_show_lowered_prints_transfers_and_costs_change_the_makespan():
    out = cli("show", "interleaved_1f1b", "--ranks", 2, "--microbatches", 4,
              "--stages-per-rank", 2, "--lowered", "--costs", "F=2,B=4")
    assert out.returncode == 0, out.stderr
    assert "0SEND_F0" in out.stdout and "(lowered)" in out.stdout
    base = cli("show", "interleaved_1f1b", "--ranks", 2, "--microbatches", 4,
               "--stages-per-rank", 2)
    span = {line for line in base.stdout.splitlines() if line.startswith("makespan: ")}
    assert len(span) == 1
    doubled = float(span.pop().split()[1]) * 2
    assert f"makespan: {doubled:g}\n" in out.stdout


@pytest.mark.parametrize("suffix", [".csv", ".txt"])
def test_show_file_loads_csv_and_text_schedules(tmp_path, suffix):
    s = Schedule.from_actions([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
    path = tmp_path / f"sched{suffix}"
    if suffix == ".csv":
        s.to_csv(path)
    else:
        path.write_text(s.to_text())
    out = cli("show", "--file", path)
    assert out.returncode == 0, out.stderr
    assert "rank 1 | 1F0" in out.stdout and "makespan: 9\n" in out.stdout


def test_show_png_writes_a_png_timeline(tmp_path):
    png = tmp_path / "zbv.png"
    out = cli("show", "zbv", "--ranks", 4, "--microbatches", 8, "--stages-per-rank", 2,
              "--png", png)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 5000
    assert f"wrote {png}" in out.stdout


def test_v_schedules_default_to_two_stages_per_rank():
    out = cli("show", "zbv", "--ranks", "2", "--microbatches", "2")
    assert out.returncode == 0, out.stderr
    assert "4 stages" in out.stdout


def test_list_prints_every_schedule_name():
    out = cli("list")
    assert out.returncode == 0
    assert out.stdout.split() == schedule_names() and "dualpipev" in out.stdout.split()


def test_help_describes_show_options():
    out = cli("show", "--help")
    assert out.returncode == 0
    for flag in ("--ranks", "--microbatches", "--stages-per-rank", "--lowered", "--costs",
                 "--png", "--file"):
        assert flag in out.stdout


@pytest.mark.parametrize("args,fragments", [
    (["show", "nope", "--ranks", "4", "--microbatches", "8"], ["'nope'", "1f1b"]),
    (["show", "zbv", "--ranks", "4", "--microbatches", "3"], ["num_microbatches=3", "num_ranks=4"]),
    (["show", "zbv", "--ranks", "4", "--microbatches", "8", "--stages-per-rank", "1"], ["stages_per_rank=1"]),
    (["show", "1f1b", "--ranks", "4"], ["--microbatches"]),
    (["show", "1f1b", "--ranks", "four", "--microbatches", "8"], ["--ranks", "four"]),
    (["show", "1f1b", "--ranks", "4", "--microbatches", "8", "--costs", "X=1"], ["'X'"]),
    (["show", "1f1b", "--ranks", "4", "--microbatches", "8", "--costs", "F=-1"], ["'F'"]),
    (["show"], ["--file"]),
    (["show", "--file", "/nonexistent/sched.csv"], ["/nonexistent/sched.csv"]),
    (["show", "--file", "x.csv", "--ranks", "2"], ["--ranks"]),
    (["frobnicate"], ["frobnicate"]),
])
def test_bad_arguments_exit_2_with_a_one_line_message(args, fragments):
    assert_one_line_error(cli(*args), *fragments)


def test_deadlocking_file_exits_2_naming_the_deadlock(tmp_path):
    path = tmp_path / "dead.txt"
    path.write_text("0: 0F0 0RECV_B0 0SEND_F0 0B0\n1: 1RECV_F0 1F0 1B0 1SEND_B0\n")
    assert_one_line_error(cli("show", "--file", path), "deadlock", "0RECV_B0")


def test_malformed_file_exits_2_naming_the_token(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("0: 0F0 0Z0\n")
    assert_one_line_error(cli("show", "--file", path), "'0Z0'")


def test_png_without_matplotlib_exits_2_with_install_hint(tmp_path, monkeypatch, capsys):
    from torch_mpmd.schedules._cli import main

    for module in ("matplotlib", "matplotlib.backends", "matplotlib.backends.backend_agg",
                   "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, module, None)  # None makes the import fail
    rc = main(["show", "1f1b", "--ranks", "2", "--microbatches", "2", "--png",
               str(tmp_path / "x.png")])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert "pip install matplotlib" in captured.err
    assert not (tmp_path / "x.png").exists()


def test_show_shard_lowers_with_unshard_and_its_cost_counts(tmp_path):
    base = cli("show", "1f1b", "--ranks", 2, "--microbatches", 2)
    sharded = cli("show", "1f1b", "--ranks", 2, "--microbatches", 2, "--shard", "--costs",
                  "UNSHARD=2")
    assert base.returncode == 0 and sharded.returncode == 0, sharded.stderr
    assert "0UNSHARD" in sharded.stdout and "1RESHARD" in sharded.stdout
    assert "makespan: 9\n" in base.stdout and "makespan: 11\n" in sharded.stdout
