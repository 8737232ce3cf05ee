"""Test setup: the Triton interpreter on CPU-only machines, hypothesis profiles, backends."""
import os

import pytest

# The suite sets every check mode explicitly or tests the "off" default: a KVWRITE_CHECK in the
# caller's environment would change the defaults under test (tests/test_check_env.py sets it
# in subprocesses).
os.environ.pop("KVWRITE_CHECK", None)
if os.environ.get("KVWRITE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", "build", "triton-cache"))

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import kvwrite  # noqa: E402

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICE = torch.device(os.environ.get("KVWRITE_TEST_DEVICE", "cpu"))
# Every backend that runs on DEVICE except the reference itself: each is compared against it.
KERNEL_BACKENDS = [b for b, why in kvwrite.backends(DEVICE).items() if why is None and b != "torch"]


@pytest.fixture
def device():
    return DEVICE


def pytest_report_header(config):
    return [f"kvwrite device: {DEVICE}; backends under test: {KERNEL_BACKENDS}",
            f"backends: {kvwrite.backends(DEVICE)}"]
