"""Bad arguments raise named errors before any kernel runs; backends; torch.compile; records."""
import pytest
import torch

import kvwrite
from conftest import DEVICE
from kvwrite.backend import BackendUnavailable
from kvwrite.errors import EMPTY, ErrorBuffer


def args(**over):
    base = dict(k=torch.randn(3, 2, 64), v=torch.randn(3, 2, 64), k_cache=torch.zeros(4, 16, 2, 64),
                v_cache=torch.zeros(4, 16, 2, 64), loc=torch.tensor([0, 5, 9]))
    base.update(over)
    return base


def call(backend="torch", **over):
    a = args(**{k: v for k, v in over.items() if k in ("k", "v", "k_cache", "v_cache", "loc")})
    kw = {k: v for k, v in over.items() if k not in a}
    kvwrite.store_kv(a["k"], a["v"], a["k_cache"], a["v_cache"], a["loc"], backend=backend, **kw)


BAD = [
    (dict(k=torch.randn(3, 64)), ValueError, "k must be 3-D"),
    (dict(k=torch.randn(3, 2, 64).to(torch.int32)), TypeError, "k must have dtype"),
    (dict(v=torch.randn(3, 2, 64, dtype=torch.float16)), TypeError, "v must have dtype"),
    (dict(v=torch.randn(4, 2, 64)), ValueError, "v must have shape"),
    (dict(k=torch.randn(3, 64, 2).transpose(1, 2)), ValueError, "k must be contiguous in its last dim"),
    (dict(k_cache=torch.zeros(4, 16, 2, 32)), ValueError, "k_cache must have shape"),
    (dict(k_cache=torch.zeros(4, 16, 128)), ValueError, "k_cache must be 4-D"),
    (dict(v_cache=torch.zeros(4, 8, 2, 64)), ValueError, "v_cache must have shape"),
    (dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float16)), TypeError, "k_cache must have dtype"),
    (dict(v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn)), TypeError, "v_cache must have dtype"),
    (dict(k_cache=torch.zeros(0, 16, 2, 64), v_cache=torch.zeros(0, 16, 2, 64)), ValueError, "at least one page"),
    (dict(loc=torch.tensor([0.0, 1.0, 2.0])), TypeError, "loc must have dtype"),
    (dict(loc=torch.tensor([0, 1])), ValueError, "loc must have one entry per token"),
    (dict(loc=torch.tensor([[0, 1, 2]])), ValueError, "loc must be 1-D"),
    (dict(loc=torch.arange(6)[::2]), ValueError, "loc must be contiguous"),
    (dict(layout="NDH"), ValueError, "layout must be one of"),
    (dict(check="strict"), ValueError, "check must be one of"),
    (dict(k_scale=torch.tensor(1.0)), ValueError, "apply only to fp8"),
    (dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn),
          v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn)), ValueError, "k_scale and v_scale are required"),
    (dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn), v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn),
          k_scale=torch.ones(3), v_scale=torch.ones(1)), ValueError, r"k_scale must have shape \[\], \[1\] or \[2\]"),
    (dict(k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn), v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn),
          k_scale=torch.ones(1, dtype=torch.float16), v_scale=torch.ones(1)), TypeError, "k_scale must have dtype"),
    (dict(loc_map=torch.zeros(4)), TypeError, "loc_map must have dtype"),
    (dict(dcp_size=0), ValueError, "dcp_size must be"),
    (dict(dcp_rank=2, dcp_size=2), ValueError, "dcp_rank must be"),
    (dict(errors=torch.zeros(3)), TypeError, "errors must be"),
    (dict(check="guard", errors="buf"), TypeError, "errors must be"),
    (dict(k=[1, 2]), TypeError, "k must be a torch.Tensor"),
    (dict(backend="fast"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("over, exc, msg", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_raise_named_errors_before_any_write(over, exc, msg):
    over = dict(over)
    backend = over.pop("backend", "torch")
    a = args()
    caches = [over.get("k_cache", a["k_cache"]), over.get("v_cache", a["v_cache"])]
    before = [c.clone() for c in caches]
    with pytest.raises(exc, match=msg):
        call(backend=backend, **over)
    assert all(torch.equal(b.view(torch.uint8), c.view(torch.uint8)) for b, c in zip(before, caches))


def test_unavailable_backend_is_a_clear_error():
    reasons = kvwrite.backends("cpu")
    assert reasons["torch"] is None and reasons["cuda"] is not None
    with pytest.raises(BackendUnavailable, match="backend='cuda' is unavailable on cpu"):
        call(backend="cuda")


def test_auto_picks_an_available_backend_and_n0_is_a_noop():
    a = args(k=torch.randn(0, 2, 64), v=torch.randn(0, 2, 64), loc=torch.zeros(0, dtype=torch.int64))
    before = a["k_cache"].clone()
    kvwrite.store_kv(a["k"], a["v"], a["k_cache"], a["v_cache"], a["loc"], check="guard")
    assert torch.equal(before, a["k_cache"])


def test_torch_compile_fullgraph_calls_the_custom_op():
    kc, vc = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    errors = ErrorBuffer("cpu")

    def layer(k, v, loc):
        k = k * 2
        kvwrite.store_kv(k, v, kc, vc, loc, check="guard", errors=errors, backend="torch")
        return k.sum()

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    compiled(k, v, torch.tensor([1, 20, 70]))
    assert torch.equal(kc.view(-1, 2, 64)[20], k[1] * 2) and torch.equal(vc.view(-1, 2, 64)[1], v[0])
    assert errors.error().loc == 70


def test_custom_op_is_registered():
    assert hasattr(torch.ops.kvwrite, "store_kv")
    kc, vc = torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 64)
    k = torch.ones(1, 1, 64)
    torch.ops.kvwrite.store_kv(k, k, kc, vc, torch.tensor([5]), "NHD", None, None, "off", None, None, 0, 1, "torch")
    assert bool((kc[1, 1] == 1).all())


def test_error_buffer_reset_and_repr():
    e = ErrorBuffer("cpu")
    assert e.error() is None and "clean" in repr(e)
    e.raise_if_any()
    assert e.tensor[1].item() == EMPTY
    assert kvwrite.default_errors("cpu") is kvwrite.default_errors(torch.device("cpu"))


def test_out_of_bounds_message_is_actionable():
    err = kvwrite.OutOfBoundsWrite("store_kv", token_index=3, loc=1040, page=65, num_pages=65,
                                   pool_page_size=16, count=2)
    text = str(err)
    assert "token 3" in text and "loc 1040" in text and "page 65" in text and "[0, 65)" in text
    assert "check_allocator" in text and err.count == 2
