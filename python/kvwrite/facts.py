"""The facts every layer reads: the op list (op codes of the guard record) and the cache formats'
constants. It sits below ops/, kernels/ and reference/ (it imports only geometry and validate),
so the kernels and the reference take their formats from here, never from `kvwrite.ops`.
The C++ extension gets the op list with the ops' programs (`ops.spec.send_programs`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kvwrite import validate
from kvwrite.geometry import require_positive_int

# --- ops ----------------------------------------------------------------------------------------
# Op codes (the index), recorded so a shared error buffer tells which op failed. Each op's
# declaration (`ops.spec.Op`) appends its name when it is made, so a new op is named nowhere
# else; the codes follow the declarations' import order (one process writes and reads a record).
OPS: list[str] = []
READ_OPS = ("gather",)   # ops whose bad loc is a read (the message says "reads")


def declare_op(name: str) -> int:
    """The op code of a newly declared op (appended once; a re-declaration keeps its code)."""
    if name not in OPS:
        OPS.append(name)
    return OPS.index(name)


def op_code(name: str) -> int:
    return OPS.index(name)


# --- store_kv: copy, fp8, int8, dynamic scales (kvwrite.reference.kv_quant has the formulas) ---------
KV_LAYOUTS = ("NHD", "HND", "cpu_attn")
# How K/V reach the cache (the kernels' QUANT constexpr / template parameter).
QUANT_COPY = 0     # cache in the input dtype
QUANT_STATIC = 1   # fp8 / int8 with a given fp32 scale ([], [1] or [H])
QUANT_TOKEN = 2    # dynamic: one scale per token over all heads, scale cache [pages, pps]
QUANT_HEAD = 3     # dynamic: one scale per token-head, scale cache [pages, pps, H]
# Cache element formats (the kernels' FMT).
FMT_SAME, FMT_E4M3, FMT_E5M2, FMT_INT8 = 0, 1, 2, 3
FORMAT_OF = {torch.float8_e4m3fn: FMT_E4M3, torch.float8_e5m2: FMT_E5M2, torch.int8: FMT_INT8}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
QUANT_DTYPES = tuple(QMAX)
SCALE_FLOOR = 1e-6   # as fp32: the smallest dynamic scale
# How a value reaches its code once the scale is known (the kernels' RULE).
RULE_RNE = 0    # x / scale, round to nearest even (kvwrite's default)
RULE_VLLM = 1   # x * (1 / scale), int8 half away from zero (vLLM's per-token-head store)
RULES = {"rne": RULE_RNE, "vllm": RULE_VLLM}

# --- store_kv's int4 format: vLLM's INT4_PER_TOKEN_HEAD (formulas: kvwrite.reference.kv_int4) ----
QUANT_INT4 = 4          # dynamic per token-head, randomized Hadamard rotation, packed 4-bit codes
FMT_INT4 = 4            # uint8 cache [pages, pps, H, D / 2]: two codes a byte, even element low
INT4_MAX_DIM = 512      # the largest head dim (csrc/kvwrite/kv_int4.h's per-head buffer)
INT4_LEVELS = 15.0      # codes 0..15: scale = max((max - min) / 15, 1e-6)
INT4_ZP_BITS = 0xF      # the zero point rides in the fp32 scale's low 4 mantissa bits
INT4_RHT_SEED = 0x9E3779B9   # torch CPU generator seed of vLLM's +-1 rotation signs (round 0)
_RHT_SIGNS: dict = {}


def int4_rht_block(head_dim: int) -> int:
    """The rotation's block: the largest power of two dividing head_dim (H_b block-diagonal)."""
    return head_dim & -head_dim


def int4_rht_signs(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 +-1 sign vector [block] of the rotation of rows of `head_dim` (vLLM's: 2 *
    bernoulli(0.5) - 1 from a CPU torch.Generator seeded INT4_RHT_SEED; cached per device)."""
    b = int4_rht_block(head_dim)
    key = (b, str(device))
    s = _RHT_SIGNS.get(key)
    if s is None:
        gen = torch.Generator(device="cpu").manual_seed(INT4_RHT_SEED)
        cpu = 2.0 * torch.bernoulli(torch.full((b,), 0.5), generator=gen) - 1.0
        s = _RHT_SIGNS[key] = cpu.to(device)
    return s

# --- DSA indexer K and DeepSeek scales ----------------------------------------------------------
AMAX_FLOOR = 1e-4   # scale = max(amax, AMAX_FLOOR) / fmax (indexer K, DeepSeek V4)


def indexer_k_row_bytes(head_dim: int, quant_block_size: int) -> int:
    """Cache bytes one token takes: D e4m3 bytes + D/qbs fp32 scales."""
    return head_dim + (head_dim // quant_block_size) * 4


def indexer_k_pool_page_size(name: str, cache_row: int, head_dim: int, quant_block_size: int) -> int:
    """Tokens per page of an indexer cache of `cache_row` bytes a page (named error if not whole)."""
    per_token = indexer_k_row_bytes(head_dim, quant_block_size)
    if cache_row % per_token or cache_row == 0:
        raise ValueError(f"{name}'s page of {cache_row} bytes is not a whole number of tokens of "
                         f"{per_token} bytes (D={head_dim} e4m3 + {head_dim // quant_block_size} fp32 scales): "
                         f"expected [num_pages, pool_page_size * {per_token}]")
    return cache_row // per_token


# --- MLA formats --------------------------------------------------------------------------------
# Kernel modes (the kernels' MODE).
MODE_COPY = 0      # row = concat(kv_c, k_pe) in the input dtype
MODE_FP8 = 1       # the same row, saturate(x / scale) in an fp8 dtype
MODE_DS_MLA = 2    # DeepSeek's fp8 MLA row, see `ds_mla_row_bytes`
MODE_NVFP4 = 3     # NVFP4 row + e4m3 block-scale row (`kernels/store_mla_nvfp4.py`)
NVFP4_BLOCK = 16   # row elements per e4m3 block scale

DS_MLA_TILE = 128                       # kv_c elements per fp32 scale
DS_MLA_SCALE_FLOOR = torch.finfo(torch.float32).tiny   # "exact": scale = max(amax / 448, FLT_MIN)
DS_MLA_POW2_FLOOR = 1e-4                # "pow2": scale = 2^ceil(log2(max(amax / 448, 1e-4)))
# fp8_ds_mla options, as flag bits beside the kernel mode (kernels and the C++ op read them from
# the format's `flags`): how the tile scale is formed and how the rope is stored.
DS_MLA_POW2 = 1 << 4       # tile scale rounded up to a power of two (floor 1e-4)
DS_MLA_RAW_ROPE = 1 << 5   # rope stored as the input's own 16-bit pattern (bf16 or fp16 bits)
DS_MLA_SCALES = {"exact": 0, "pow2": DS_MLA_POW2}
DS_MLA_ROPES = {"bf16": 0, "input": DS_MLA_RAW_ROPE}


def ds_mla_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one fp8_ds_mla row: L e4m3 latent bytes, L/128 fp32 tile scales, R bf16 rope."""
    return dims_expr(DS_MLA_WIDTH, kv_lora_rank, rope_dim)


DS_MLA_WIDTH = f"L + L / {DS_MLA_TILE} * 4 + 2 * R"


@functools.lru_cache(maxsize=None)   # the formats' few texts: compiled once, not per call
def _dims_code(text: str):
    return compile(text.replace("/", "//"), "<dims_expr>", "eval")


def dims_expr(text: str, L: int, R: int) -> int:
    """An integer expression of L, R in the C++ matcher's syntax (csrc/expr.h): the formats' row
    widths and dims rules, written once for both (L, R may be SymInts while tracing)."""
    return int(eval(_dims_code(text), {"__builtins__": {}}, {"L": L, "R": R}))  # noqa: S307


@dataclass(frozen=True)
class MLAFormat:
    """One `kv_cache_dtype`: its cache and kernel mode; `width` and `rule` are expressions of L
    (kv_lora_rank) and R (rope_dim) for the Python checks and the C++ matcher (kvwrite.ops.mla)."""

    name: str
    mode: int
    cache: Optional[torch.dtype]   # the cache dtype; None: the input's
    width: str                     # the cache row, in cache elements
    takes_scale: bool = False
    rule: str = ""                 # the dims rule ("" none) and its message ({L}, {R} filled in)
    rule_message: str = ""
    takes_scale_cache: bool = False   # nvfp4: scale_cache, global_scale
    flags: int = 0                    # fp8_ds_mla: DS_MLA_* bits

    @property
    def kernel_mode(self) -> int:
        """The mode the kernels take: MODE_* with the format's option bits."""
        return self.mode | self.flags

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.cache is None else self.cache

    def row_width(self, L: int, R: int) -> int:
        return dims_expr(self.width, L, R)

    def dims(self, L: int, R: int) -> Optional[str]:
        """The dims rule's message when (L, R) breaks it, else None."""
        return None if not self.rule or dims_expr(self.rule, L, R) else self.rule_message.format(L=L, R=R)


def ds_mla_format(scale: str = "exact", rope: str = "bf16") -> str:
    """The kv_cache_dtype name of fp8_ds_mla with tile scale `scale` ("exact" | "pow2") and rope
    `rope` ("bf16" | "input"; docs/formats.md), e.g. "fp8_ds_mla+pow2+input"."""
    validate.choice("ds_mla_scale", scale, tuple(DS_MLA_SCALES))
    validate.choice("ds_mla_rope", rope, tuple(DS_MLA_ROPES))
    return "fp8_ds_mla" + ("+pow2" if scale == "pow2" else "") + ("+input" if rope == "input" else "")


_DS_MLA_RULE = (f"L % {DS_MLA_TILE} == 0", "kv_cache_dtype='fp8_ds_mla' needs kv_c's last dim (kv_lora_rank) to "
                f"be a multiple of {DS_MLA_TILE}, got {{L}}")
MLA_FORMATS: dict[str, MLAFormat] = {f.name: f for f in (
    MLAFormat("auto", MODE_COPY, None, "L + R"),
    MLAFormat("fp8_e4m3", MODE_FP8, torch.float8_e4m3fn, "L + R", takes_scale=True),
    MLAFormat("fp8_e5m2", MODE_FP8, torch.float8_e5m2, "L + R", takes_scale=True),
    MLAFormat("fp8_e4m3fnuz", MODE_FP8, torch.float8_e4m3fnuz, "L + R", takes_scale=True),
    *(MLAFormat(ds_mla_format(sc, rp), MODE_DS_MLA, torch.uint8, DS_MLA_WIDTH,
                rule=_DS_MLA_RULE[0], rule_message=_DS_MLA_RULE[1], flags=DS_MLA_SCALES[sc] | DS_MLA_ROPES[rp])
      for sc in DS_MLA_SCALES for rp in DS_MLA_ROPES),
    MLAFormat("nvfp4", MODE_NVFP4, torch.uint8, "(L + R) / 2", rule=f"(L + R) % {NVFP4_BLOCK} == 0",
              rule_message=f"kv_cache_dtype='nvfp4' needs kv_lora_rank + rope_dim to be a multiple of "
                           f"{NVFP4_BLOCK}, got {{L}} + {{R}}", takes_scale_cache=True),
)}

# --- DeepSeek V4 (layouts on kvwrite.reference.dsv4) -------------------------------------------------
NOPE = 448                  # e4m3 values a row
ROPE = 64                   # bf16 values a row
KV_DIM = NOPE + ROPE        # 512 input values a token
TILE = 64                   # NoPE values per ue8m0 scale
TILES = NOPE // TILE        # 7
DATA_ROW = NOPE + 2 * ROPE  # 576 bytes
SCALE_ROW = TILES + 1       # 8 bytes: 7 scales + 1 pad
TOKEN_BYTES = DATA_ROW + SCALE_ROW   # 584
PAGE_ALIGN = 576
INDEXER_FMTS = ("fp8", "mxfp4")
FP8_BLOCK = 128             # indexer values per fp32 scale ("fp8")
MXFP4_BLOCK = 32            # indexer values per ue8m0 scale ("mxfp4")
INDEXER_FMT_CODE = {"fp8": 0, "mxfp4": 1}
RATIOS = (4, 128)           # the compressed caches of V4
# DeepSeek-V4.1's fp8 record (SGLang's V41 / V41_NEW layouts): all 512 values e4m3, one ue8m0 scale
# per 32, 2^ceil(log2(max(amax / 448, 1e-4))); a page is its data rows then its scale rows, padded
# to a multiple of 512 bytes (V41_NEW: each token's data then its scales, no padding)
V41_FP8_GROUP = 32
V41_FP8_SCALES = KV_DIM // V41_FP8_GROUP      # 16
V41_FP8_TOKEN = KV_DIM + V41_FP8_SCALES       # 528 bytes
V41_FP8_PAGE_ALIGN = KV_DIM


def v41_fp8_page_bytes(pool_page_size: int, interleaved: bool = False) -> int:
    """Bytes of one V4.1 fp8 page: pool_page_size * 528, block-split pages padded to 512 (64 -> 33792)."""
    raw = require_positive_int("page_size", pool_page_size) * V41_FP8_TOKEN
    return raw if interleaved else -(-raw // V41_FP8_PAGE_ALIGN) * V41_FP8_PAGE_ALIGN


def kv_page_bytes(pool_page_size: int) -> int:
    """Bytes of one KV page: ceil(pool_page_size * 584 / 576) * 576 (256 -> 149760, 64 -> 37440,
    2 -> 1728)."""
    pps = require_positive_int("page_size", pool_page_size)
    return -(-pps * TOKEN_BYTES // PAGE_ALIGN) * PAGE_ALIGN


def kv_pool_page_size(name: str, page_bytes: int, page_size: object = None) -> int:
    """Tokens per page of a KV cache of `page_bytes` a page: `page_size` checked, or derived if None."""
    if page_size is None:
        pps = max(1, (page_bytes - PAGE_ALIGN) // TOKEN_BYTES)   # kv_page_bytes is increasing
        while kv_page_bytes(pps) < page_bytes:
            pps += 1
        if kv_page_bytes(pps) != page_bytes:
            raise ValueError(f"{name}'s page of {page_bytes} bytes is not a DeepSeek V4 KV page "
                             f"(ceil(page_size * {TOKEN_BYTES} / {PAGE_ALIGN}) * {PAGE_ALIGN} bytes)")
        return pps
    pps = require_positive_int("page_size", page_size)
    if kv_page_bytes(pps) != page_bytes:
        raise ValueError(f"{name} must have pages of kv_page_bytes({pps}) = {kv_page_bytes(pps)} "
                         f"bytes for page_size={pps}, got {page_bytes}")
    return pps


def indexer_row_bytes(head_dim: int, fmt: str = "fp8") -> int:
    """Indexer cache bytes a row: fp8 D + D/128*4 (132), mxfp4 D/2 + D/32 (68)."""
    if fmt == "mxfp4":
        return head_dim // 2 + head_dim // MXFP4_BLOCK
    return head_dim + (head_dim // FP8_BLOCK) * 4


def indexer_pool_page_size(name: str, page_bytes: int, head_dim: int, fmt: str,
                           page_size: object = None) -> int:
    return records_per_page(name, page_bytes, indexer_row_bytes(head_dim, fmt), page_size,
                            f"fmt={fmt!r}, D={head_dim}", f"{fmt} indexer rows", f" (D={head_dim})")


def records_per_page(name: str, page_bytes: int, per: int, page_size: object, about: str,
                     records: str, suffix: str = "") -> int:
    """Records of `per` bytes in a page of `page_bytes` (`page_size` of them if given), else a named error."""
    if page_size is not None:
        pps = require_positive_int("page_size", page_size)
        if pps * per != page_bytes:
            raise ValueError(f"{name} must have pages of page_size * {per} = {pps * per} bytes "
                             f"({about}), got {page_bytes}")
        return pps
    if page_bytes == 0 or page_bytes % per:
        raise ValueError(f"{name}'s page of {page_bytes} bytes is not a whole number of {records} "
                         f"of {per} bytes{suffix}")
    return page_bytes // per


# --- DeepSeek V4 FP4 KV records (layouts on kvwrite.reference.dsv4_fp4) --------------------------------
V41_SCALE_FLOOR = 2.0 ** -9   # nvfp4_v41: e4m3 block scale = e4m3(max(amax / 6, 2**-9))


@dataclass(frozen=True)
class FP4Record:
    """One FP4 record of a DeepSeek V4 KV token (docs/formats.md): `quant` packed e2m1 values, a
    scale per `block` in a `scale_row` of bytes, `rope` bf16 values; `inline`: the scales inside the
    token's row, else after the page's data rows (FlashMLA's split page)."""

    name: str
    code: int
    quant: int
    block: int
    scale: str
    rope: int
    scale_row: int
    inline: bool
    floor: float = 0.0

    @property
    def blocks(self) -> int:
        return self.quant // self.block

    @property
    def data_row(self) -> int:
        """Bytes of a token's data row (the whole token when inline)."""
        return self.quant // 2 + 2 * self.rope + (self.scale_row if self.inline else 0)

    @property
    def token_bytes(self) -> int:
        return self.quant // 2 + 2 * self.rope + self.scale_row

    @property
    def rope_at(self) -> int:
        """Byte of the bf16 rope within the data row."""
        return self.quant // 2 + (self.scale_row if self.inline else 0)


FP4_RECORDS: dict[str, FP4Record] = {r.name: r for r in (
    # FlashInfer PR #4955 / SGLang PR #38646 / vLLM nvfp4_fi_ds_mla: 352 data + 32 scale bytes
    FP4Record("nvfp4", 0, NOPE, NVFP4_BLOCK, "e4m3", ROPE, 32, False),
    # DeepSeek-V4.1 (vLLM PR #57344, FlashMLA V41_FP4): all 512 values e2m1, 256 + 32 bytes
    FP4Record("nvfp4_v41", 1, KV_DIM, NVFP4_BLOCK, "e4m3", 0, 32, False, V41_SCALE_FLOOR),
    # SGLang PR #37138 (fp4_e2m1): [224 e2m1 | 14 e8m0 + 2 pad | 128 bf16 rope] a row
    FP4Record("mxfp4", 2, NOPE, MXFP4_BLOCK, "ue8m0", ROPE, 16, True),
)}
FP4_FMTS = tuple(FP4_RECORDS)


def fp4_pool_page_size(name: str, page_bytes: int, fmt: str, page_size: object = None) -> int:
    """Tokens per page of an FP4 KV cache of `page_bytes` a page (`records_per_page`)."""
    return records_per_page(name, page_bytes, FP4_RECORDS[fmt].token_bytes, page_size,
                            f"fmt={fmt!r}", f"{fmt!r} records")
