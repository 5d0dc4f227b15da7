"""Published numbers that densetrain checks: the one source of the tests' reference values and
of docs/reproductions.md (``python -m densetrain.scaling.reproductions --write``).

Each ``Reference`` holds a disclosed number, where it is printed, the tolerance the test
allows, the test that asserts it, and a function computing densetrain's own value (in
``densetrain.scaling.reproduce``), so the page shows both and cannot drift from the tests.
Published parameter counts of the presets live in the presets themselves
(``extra["published_params"]``) and are listed on the page from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from densetrain.scaling import reproduce


@dataclass(frozen=True, kw_only=True)
class Reference:
    """One disclosed number and how densetrain reproduces it."""

    key: str
    quantity: str
    paper: str
    where: str
    published: float
    tolerance: float
    """Largest |densetrain - published| the test accepts, in the unit of ``published``."""
    test: str
    """``path::function`` of the test that asserts it."""
    reproduce: object
    """Zero-argument callable returning densetrain's value."""
    unit: str = ""


# PaLM (Chowdhery et al. 2022): Table 1 size; §4 / Table 3 throughput and MFU.
PALM_540B_PARAMS = 540.35e9
PALM_TOKENS_PER_S = 238.3e3
PALM_CHIPS = 6144
TPU_V4_PEAK_FLOPS = 275e12
PALM_MFU = 0.462
# GPT-3 (Brown et al. 2020): Table 2.1 size; Table D.1 training compute over 300B tokens.
GPT3_175B_PARAMS = 175.0e9
GPT3_TRAIN_TOKENS = 300e9
GPT3_TRAIN_FLOPS = 3.14e23
# ZeRO (Rajbhandari et al. 2020), Figure 1: model-state GB per device for 7.5B parameters on 64
# devices with mixed-precision Adam (K = 12), by stage 0-3.
ZERO_FIGURE1_PARAMS = 7.5e9
ZERO_FIGURE1_DEVICES = 64
ZERO_FIGURE1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
# Hoffmann et al. 2022, Table A4: (layers, d_model, ffw_size, heads, FLOPs ratio to 6ND).
CHINCHILLA_TABLE_A4 = (
    (10, 640, 2560, 10, 1.03),
    (20, 1024, 4096, 16, 1.10),
    (24, 1280, 5120, 10, 1.08),
    (26, 1792, 7168, 14, 1.04),
    (28, 2048, 8192, 16, 1.03),
    (40, 3584, 14336, 28, 0.99),
)
# Hoffmann et al. 2022: approach 3 N_opt at the Gopher budget (Figure 4, ~40B), Table A3 (67B at
# 1.71e24 FLOPs), Table 2 exponent a = 0.46.
GOPHER_BUDGET_FLOPS = 5.76e23
CHINCHILLA_FIG4_NOPT = 40e9
TABLE_A3_FLOPS = 1.71e24
TABLE_A3_NOPT = 67e9
CHINCHILLA_APPROACH3_A = 0.46
# Kaplan et al. 2020 §1.2: N ∝ C^0.73, B ∝ C^0.24 (empirical), which eqs. 1.7-1.8 "closely match".
KAPLAN_N_EXPONENT = 0.73
KAPLAN_B_EXPONENT = 0.24
# Korthikanti et al. 2022 eq. 1: activation bytes per layer sbh(34 + 5as/h), GPT-3 175B's shape
# (Table 3: s = 2048, h = 12288, a = 96) at micro-batch 1.
KORTHIKANTI_SHAPE = {"s": 2048, "b": 1, "h": 12288, "a": 96}

# Preset sizes against the published figure (tests/unit/models/test_presets.py).
# Families in `transformers` must equal its count exactly; the published figure is a guard
# within 6%, since names round sizes loosely (OPT-350M has 331M parameters, Llama-2-7B 6.74B).
HF_PUBLISHED_REL_TOL = 0.06
PHI1_PUBLISHED_PARAMS = 1.418e9
"""phi-1 (Gunasekar et al. 2023) says "1.3B"; the microsoft/phi-1 model card lists 1.42B."""
# Families without a transformers implementation: (relative, absolute) tolerance. GPT-3 Table
# 2.1 rounds to two significant figures (largest gap GPT-3 Medium, 1.7%); PaLM Table 1 gives
# two decimals in billions (within 0.01B); Gopher Table 1 / Chinchilla Table 4 round to 2-3
# significant figures and include Transformer-XL relative-position projections (largest gap
# Gopher 1.4B, 1.9%).
PUBLISHED_PARAMS_TOLERANCE = {
    "gpt3": (0.02, 0.0),
    "palm": (0.0, 0.01e9),
    "gopher": (0.02, 0.0),
    "chinchilla": (0.02, 0.0),
}

_SIZING = "tests/unit/models/test_sizing.py"
_MEMORY = "tests/unit/planner/test_planner_memory.py"
_COMPUTE = "tests/unit/planner/test_planner_compute_comm.py"
_OPTIMAL = "tests/unit/scaling/test_scaling_optimal.py"


def _a4(row: tuple) -> Reference:
    layers, d_model, ffw, heads, ratio = row
    return Reference(
        key=f"chinchilla-a4-{d_model}", quantity=f"FLOPs / 6ND, {layers} layers, d {d_model}",
        paper="Hoffmann et al. 2022 (Chinchilla)", where="Table A4", published=ratio,
        tolerance=0.005, test=f"{_SIZING}::test_chinchilla_table_a4_ratios",
        reproduce=lambda: reproduce.chinchilla_a4_ratio(layers, d_model, ffw, heads))


def _zero(stage: int) -> Reference:
    return Reference(
        key=f"zero-stage{stage}", quantity=f"model states per device, ZeRO stage {stage}",
        paper="Rajbhandari et al. 2020 (ZeRO)", where="Figure 1", unit="GB",
        published=ZERO_FIGURE1_GB[stage], tolerance=0.05,
        test=f"{_MEMORY}::test_zero_paper_model_states_for_7_5b_on_64_devices",
        reproduce=lambda: reproduce.zero_model_state_gb(ZERO_FIGURE1_PARAMS,
                                                        ZERO_FIGURE1_DEVICES, stage))


REFERENCES: tuple[Reference, ...] = (
    Reference(key="palm-540b-params", quantity="PaLM 540B parameters",
              paper="Chowdhery et al. 2022 (PaLM)", where="Table 1", published=PALM_540B_PARAMS,
              tolerance=PALM_540B_PARAMS * 1e-3,
              test=f"{_SIZING}::test_palm_540b_size_and_published_mfu",
              reproduce=reproduce.palm_540b_params),
    Reference(key="palm-540b-mfu", quantity="PaLM 540B MFU at 238.3k tokens/s on 6144 TPU v4",
              paper="Chowdhery et al. 2022 (PaLM)", where="Table 3, Appendix B",
              published=PALM_MFU, tolerance=0.0005,
              test=f"{_COMPUTE}::test_palm_mfu_from_published_numbers",
              reproduce=lambda: reproduce.palm_540b_mfu(PALM_TOKENS_PER_S, PALM_CHIPS,
                                                  TPU_V4_PEAK_FLOPS)),
    Reference(key="gpt3-175b-params", quantity="GPT-3 175B parameters",
              paper="Brown et al. 2020 (GPT-3)", where="Table 2.1", published=GPT3_175B_PARAMS,
              tolerance=GPT3_175B_PARAMS * 5e-3,
              test=f"{_SIZING}::test_gpt3_175b_training_compute",
              reproduce=reproduce.gpt3_175b_params),
    Reference(key="gpt3-175b-flops", quantity="GPT-3 175B training FLOPs (300B tokens)",
              paper="Brown et al. 2020 (GPT-3)", where="Table D.1", published=GPT3_TRAIN_FLOPS,
              tolerance=GPT3_TRAIN_FLOPS * 5e-3,
              test=f"{_SIZING}::test_gpt3_175b_training_compute",
              reproduce=lambda: reproduce.gpt3_175b_training_flops(GPT3_TRAIN_TOKENS)),
    *(_a4(row) for row in CHINCHILLA_TABLE_A4),
    *(_zero(stage) for stage in sorted(ZERO_FIGURE1_GB)),
    Reference(key="korthikanti-eq1", quantity="activation bytes per layer, GPT-3 175B shape, "
              "no parallelism", paper="Korthikanti et al. 2022", where="eq. 1, Table 3",
              published=reproduce.korthikanti_eq1(**KORTHIKANTI_SHAPE), unit="bytes",
              tolerance=reproduce.korthikanti_eq1(**KORTHIKANTI_SHAPE) * 1e-12,
              test=f"{_MEMORY}::test_korthikanti_activation_forms",
              reproduce=lambda: reproduce.gpt3_layer_activation_bytes(KORTHIKANTI_SHAPE)),
    Reference(key="chinchilla-fig4-nopt", quantity="approach 3 N_opt at 5.76e23 FLOPs",
              paper="Hoffmann et al. 2022 (Chinchilla)", where="Figure 4",
              published=CHINCHILLA_FIG4_NOPT, tolerance=1e9,
              test=f"{_OPTIMAL}::test_chinchilla_closed_form_gives_40b_at_gopher_budget",
              reproduce=lambda: reproduce.chinchilla_nopt(GOPHER_BUDGET_FLOPS)),
    Reference(key="chinchilla-a3-nopt", quantity="approach 3 N_opt at 1.71e24 FLOPs",
              paper="Hoffmann et al. 2022 (Chinchilla)", where="Table A3",
              published=TABLE_A3_NOPT, tolerance=TABLE_A3_NOPT * 0.03,
              test=f"{_OPTIMAL}::test_chinchilla_closed_form_matches_table_a3_67b",
              reproduce=lambda: reproduce.chinchilla_nopt(TABLE_A3_FLOPS)),
    Reference(key="chinchilla-a", quantity="approach 3 exponent a of N_opt ∝ C^a",
              paper="Hoffmann et al. 2022 (Chinchilla)", where="Table 2",
              published=CHINCHILLA_APPROACH3_A, tolerance=0.005,
              test=f"{_OPTIMAL}::test_closed_form_exponents_are_beta_and_alpha_over_their_sum",
              reproduce=reproduce.chinchilla_params_exponent),
    Reference(key="kaplan-n-exponent", quantity="N ∝ C^x from eqs. 1.7-1.8 vs the empirical "
              "0.73", paper="Kaplan et al. 2020", where="§1.2, Table 5",
              published=KAPLAN_N_EXPONENT, tolerance=0.05,
              test=f"{_OPTIMAL}::test_kaplan_exponents_from_published_alphas",
              reproduce=lambda: reproduce.kaplan_exponent("N")),
    Reference(key="kaplan-b-exponent", quantity="B ∝ C^x from eqs. 1.7-1.8 vs the empirical "
              "0.24", paper="Kaplan et al. 2020", where="§1.2, Table 5",
              published=KAPLAN_B_EXPONENT, tolerance=0.02,
              test=f"{_OPTIMAL}::test_kaplan_exponents_from_published_alphas",
              reproduce=lambda: reproduce.kaplan_exponent("B")),
)

BY_KEY = {ref.key: ref for ref in REFERENCES}


@dataclass(frozen=True, kw_only=True)
class Unreproducible:
    """A published claim that cannot be checked from what was disclosed."""

    claim: str
    paper: str
    missing: str


UNREPRODUCIBLE: tuple[Unreproducible, ...] = (
    Unreproducible(
        claim="Mistral 7B's training compute and tokens per parameter",
        paper="Jiang et al. 2023 (Mistral 7B)",
        missing="the number of training tokens is not disclosed, so the model cannot be placed "
                "on the (N, D) plane (docs/overtraining.md)"),
    Unreproducible(
        claim="Figure 1: a 7B model trained longer instead of a 13B saves 1.7e22 FLOPs (17%) "
              "at 2T inference tokens",
        paper="Sardana et al. 2024 (Beyond Chinchilla-Optimal)",
        missing="the 13B model's training tokens and the law's constants behind the figure are "
                "not stated; with the printed Chinchilla constants and the 13B at its "
                "Chinchilla point, densetrain finds a 9.1% saving for 7B and an optimum at 8.0B "
                "(10.1%); the direction of the claim is tested (tests/unit/scaling/"
                "test_scaling_inference.py)"),
    Unreproducible(
        claim="Approaches 1 and 2 exponents (a = 0.50 and 0.49) of N_opt ∝ C^a",
        paper="Hoffmann et al. 2022 (Chinchilla), Table 2",
        missing="the more than 400 training runs (losses by N, D) were not released; densetrain "
                "reproduces the fitting procedures on its own sweeps (docs/scaling.md), not "
                "these numbers"),
    Unreproducible(
        claim="Kaplan et al.'s fitted constants (α_N = 0.076, N_c = 8.8e13, ...)",
        paper="Kaplan et al. 2020, Table 5",
        missing="the runs behind the fits are not released; densetrain recovers the constants "
                "from data generated with them, and uses them as published"),
    Unreproducible(
        claim="Llama 3 8B/70B trained on 'over 15T' tokens: the exact token counts",
        paper="Meta 2024 (Llama 3 model card); Dubey et al. 2024",
        missing="only a lower bound is disclosed for 8B and 70B (15.6T is given for 405B); "
                "the over-training page uses 15T"),
)
