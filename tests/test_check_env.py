"""`KVWRITE_CHECK`: the process default check mode (each case runs in a fresh interpreter)."""
import os
import subprocess
import sys

import pytest
import torch

import kvwrite
from kvwrite import validate

ROOT = os.path.join(os.path.dirname(__file__), "..")

# One out-of-range token (loc 9 in a 2-page x 2-row pool) and one good one, on the torch backend.
SCRIPT = r"""
import sys, torch, kvwrite
k = torch.ones(2, 1, 4); v = torch.ones(2, 1, 4)
kc = torch.zeros(2, 2, 1, 4); vc = torch.zeros(2, 2, 1, 4)
loc = torch.tensor([1, 9])
explicit = sys.argv[1] if len(sys.argv) > 1 else None
try:
    kvwrite.store_kv(k, v, kc, vc, loc, backend="torch", check=explicit)
except kvwrite.OutOfBoundsWrite as e:
    print("RAISED", e)
print("WROTE", int(kc.reshape(4, 4)[1].sum()))
"""


def run(env_value, *argv, script=SCRIPT):
    env = dict(os.environ)
    env.pop("KVWRITE_CHECK", None)
    if env_value is not None:
        env["KVWRITE_CHECK"] = env_value
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True,
                          text=True, timeout=120)


def test_unset_default_is_off_and_none_resolves_to_it():
    assert validate.DEFAULT_CHECK == "off"  # conftest removes KVWRITE_CHECK
    assert validate.check_mode(None) == "off"
    assert validate.check_mode("guard") == "guard"


def test_assert_from_the_environment():
    r = run("assert")
    assert r.returncode == 0, r.stderr
    assert "RAISED store_kv: token 1 writes loc 9" in r.stdout
    assert "WROTE 0" in r.stdout  # validated before any write


def test_explicit_check_wins_over_the_environment():
    r = run("guard", "assert")
    assert r.returncode == 0, r.stderr
    assert "RAISED store_kv: token 1 writes loc 9" in r.stdout and "WROTE 0" in r.stdout
    assert "kvwrite:" not in r.stderr  # nothing recorded in the default buffer


def test_guard_from_the_environment_reports_at_exit():
    r = run("GUARD")  # case-insensitive
    assert r.returncode == 0, r.stderr
    assert "RAISED" not in r.stdout and "WROTE 4" in r.stdout
    msg = ("kvwrite: guard mode skipped bad writes on cpu that were never checked "
           "(kvwrite.default_errors('cpu').raise_if_any()): store_kv: token 1 writes loc 9 into "
           "page 4, but the pool has pages [0, 2) of 2 rows (capacity 4)")
    assert msg in r.stderr, r.stderr


def test_guard_exit_report_is_silent_once_checked():
    script = SCRIPT + "kvwrite.default_errors('cpu').reset()\n"
    r = run("guard", script=script)
    assert r.returncode == 0 and "kvwrite:" not in r.stderr, r.stderr


def test_guard_exit_report_is_silent_for_a_record_already_raised():
    script = SCRIPT + ("try:\n    kvwrite.default_errors('cpu').raise_if_any()\n"
                       "except kvwrite.OutOfBoundsWrite as e:\n    print('CAUGHT', e.token_index)\n")
    r = run("guard", script=script)
    assert r.returncode == 0 and "CAUGHT 1" in r.stdout and "kvwrite:" not in r.stderr, r.stderr
    # a bad write after the read is new: reported at exit
    r = run("guard", script=script + SCRIPT.split("\n", 1)[1])
    assert r.returncode == 0 and "never checked" in r.stderr, r.stderr


@pytest.mark.parametrize("value", ["on", "1", "guard,assert"])
def test_bad_value_is_a_clear_error(value):
    r = run(value)
    assert r.returncode != 0
    assert f"KVWRITE_CHECK={value!r} is not a check mode: set it to one of off|assert|guard" in r.stderr


def test_report_default_errors_writes_the_full_message(capsys):
    buf = kvwrite.default_errors("cpu")
    buf.reset()
    kc = torch.zeros(1, 2, 1, 4)
    kvwrite.store_kv(torch.ones(1, 1, 4), torch.ones(1, 1, 4), kc, kc.clone(),
                     torch.tensor([-5]), backend="torch", check="guard")
    try:
        from kvwrite.errors import report_default_errors
        assert report_default_errors() == 1
        err = capsys.readouterr().err
        assert "store_kv: token 0 writes loc -5 into page -3" in err and "padding must be -1" in err
    finally:
        buf.reset()


def test_built_pools_take_the_environment_default():
    script = ("import kvwrite\n"
              "m = kvwrite.ModelSpec('mha', 2, num_kv_heads=1, head_dim=16)\n"
              "c = kvwrite.KVCacheConfigurator(m, page_size=4, max_total_num_tokens=16)\n"
              "print('POOL', c.build().check, c.build(check='off').check)\n")
    r = run("assert", script=script)
    assert r.returncode == 0, r.stderr
    assert "POOL assert off" in r.stdout
