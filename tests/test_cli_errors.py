"""The `kvwrite` command line: every bad argument or environment value is one line on stderr and
exit status 2 (no traceback, no work done); a closed stdout is quiet; every option has help."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

from kvwrite import cli

ROOT = os.path.join(os.path.dirname(__file__), "..")
# A CUDA device this machine does not have: "cuda" here, an index past the last GPU elsewhere.
NO_GPU = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"

BAD = {
    "demo --device <no gpu>": (["demo", "--device", NO_GPU], "no CUDA device here" if NO_GPU == "cuda" else "CUDA device(s)"),
    "demo --device foo": (["demo", "--device", "foo"], "'foo' is not a device"),
    "demo --device meta": (["demo", "--device", "meta"], "cpu or cuda[:N], not meta"),
    "demo --backend nope": (["demo", "--backend", "nope"], "invalid choice: 'nope'"),
    "demo --backend <not here>": (["demo", "--device", "cpu", "--backend", "cuda"], "--backend cuda does not run on cpu"),
    "bench --cases nope": (["bench", "--cases", "nope"], "unknown case 'nope'"),
    "bench --cases ok,nope": (["bench", "--cases", "mha-bf16,nope"], "unknown case 'nope'"),
    "bench --device <no gpu>": (["bench", "--device", NO_GPU], "--device"),
    "bench --out /proc/nope": (["bench", "--device", "cpu", "--cases", "mha-bf16", "--sizes", "1",
                                "--out", "/proc/nope/x"], "--out /proc/nope/x: cannot write there"),
    "bench --backends nope": (["bench", "--backends", "nope"], "unknown backend 'nope'"),
    "bench --backends <not here>": (["bench", "--device", "cpu", "--backends", "cuda"],
                                    "--backends cuda cannot be timed on cpu"),
    "bench --checks strict": (["bench", "--checks", "strict"], "unknown check mode 'strict'"),
    "bench --checks guard,strict": (["bench", "--checks", "guard,strict"], "unknown check mode 'strict'"),
    "bench --sizes 0": (["bench", "--sizes", "0"], "every size must be an integer >= 1"),
    "bench --sizes 1,x": (["bench", "--sizes", "1,x"], "not a comma-separated list of integers"),
    "bench --min-time 0": (["bench", "--min-time", "0"], "must be a finite number > 0"),
    "bench --threads -1": (["bench", "--threads", "-1"], "must be >= 0"),
    "plan --tp 0": (["plan", "--preset", "llama-3.1-8b", "--tp", "0"], "must be >= 1"),
    "plan --memory lots": (["plan", "--preset", "llama-3.1-8b", "--memory", "lots"], "not a size: 'lots'"),
    "plan --preset nope": (["plan", "--preset", "nope"], "no preset 'nope'"),
    "plan (no model)": (["plan"], "one of the arguments --preset --config is required"),
    "no command": ([], "the following arguments are required: COMMAND"),
    "unknown command": (["frobnicate"], "invalid choice: 'frobnicate'"),
}


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv, needle", list(BAD.values()), ids=list(BAD))
def test_bad_invocation_is_one_line_and_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written, wherever the command would write
    try:
        rc = cli.main(argv)
    except SystemExit as exit_:  # argparse refuses while parsing
        rc = exit_.code
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    line = one_line(err)
    assert line.startswith("kvwrite"), line
    assert needle in line, line
    assert out == ""
    assert not os.listdir(tmp_path)


def run_cli(*argv, env=None, stdout=subprocess.PIPE):
    """The installed entry point, `python -m kvwrite.cli`, in a fresh interpreter."""
    e = dict(os.environ)
    e.pop("KVWRITE_CHECK", None)
    e.update(env or {})
    e["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kvwrite.cli", *argv], env=e, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300)


def test_bad_check_environment_is_one_line_and_exit_2():
    r = run_cli("presets", env={"KVWRITE_CHECK": "strict"})
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert line == ("kvwrite: error: KVWRITE_CHECK='strict' is not a check mode: set it to one of "
                    "off|assert|guard (or unset it for 'off')"), line
    assert r.stdout == ""


def test_closed_stdout_is_quiet():
    """`kvwrite plan --json | head -1`: the reader goes away after one line; no traceback, no
    'Exception ignored' at exit, the status a shell gives a command stopped by SIGPIPE."""
    cmd = [sys.executable, "-m", "kvwrite.cli", "plan", "--preset", "deepseek-v3", "--json"]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + ROOT)
    env.pop("KVWRITE_CHECK", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=300)
    assert first.strip() == b"{"
    assert err == "", err
    assert rc in (0, cli.EXIT_BROKEN_PIPE)  # 0 if everything fit in the pipe before it closed


def test_broken_pipe_inside_a_command_is_quiet(capsys, monkeypatch):
    """The same, in process: a write that meets a closed pipe ends the command with 141, silent."""
    from kvwrite.cli import presets

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(presets, "run", closed)
    monkeypatch.setattr(cli._args, "quiet_broken_pipe", lambda: None)  # keep pytest's stdout
    monkeypatch.setattr(cli, "quiet_broken_pipe", lambda: None)
    assert cli.main(["presets"]) == cli.EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


def _options():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            if not isinstance(action, argparse._HelpAction):
                yield name, action


@pytest.mark.parametrize("command, action", list(_options()),
                         ids=[f"{c} {'/'.join(a.option_strings)}" for c, a in _options()])
def test_every_option_has_help(command, action):
    assert action.help and action.help != argparse.SUPPRESS and len(action.help) > 10, (command, action)


def test_every_command_has_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert set(helps) == set(sub.choices) and all(helps.values()), helps


def test_presets_show_the_v4_heads(capsys):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "0 KV heads" not in out
    v4 = [line for line in out.splitlines() if "deepseek-v4" in line]
    assert len(v4) == 2 and all("1 KV head x 512 (448 NoPE + 64 RoPE)" in line for line in v4), v4
