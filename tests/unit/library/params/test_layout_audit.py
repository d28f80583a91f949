"""The audit of both model zoos (tests/layout_audit.py): every family of the installed
`transformers` at its default config (at most 4 layers per stack where the config allows: the
same findings as all layers, measured) and every torchtitan family's debug flavors, built on the
`meta` device and routed for Muon.

Fails when a 2-D weight named like a fused one is neither described by params/fused_layouts.py's
table nor in NOT_SPLIT below (docs/fsdp2.md lists the same, with the reasons), when an N-D tensor
goes to the scalar optimizer without being named at build, when a layout function does not fit its
weight (matrix_layouts raises), or when a family no longer builds for a reason not listed. A new
release of either package shows its new layouts here.
"""

import time
from pathlib import Path

import pytest

from tests import layout_audit

pytest.importorskip("transformers")
pytest.importorskip("torchtitan")

# 2-D weights named like fused ones that Muon orthogonalizes whole, named at build
# (routing_fallbacks): layouts not read from their forwards yet (none left; docs/fsdp2.md).
NOT_SPLIT: frozenset[str] = frozenset()
# Families that do not build here at their default config: optional packages (timm, natten,
# torchaudio, detectron2, fla for torchtitan's Qwen3.5), or a default config incomplete on its own
# in transformers 5.24 (TypeError, AttributeError, ValueError while building). Audited by name only.
NOT_BUILDABLE = {
    "autoformer", "aya_vision", "chameleon", "cohere_compass", "cohere_compass_text", "conditional_detr", "dab-detr",
    "dbrx", "deepseek_ocr2", "deformable_detr", "detr", "diffusion_gemma", "dinat", "dots1", "edgetam",
    "edgetam_vision_model", "emu3", "esm", "fast_vlm", "gemma3n", "gemma3n_vision", "granite4_vision",
    "higgs_audio_v2_tokenizer", "hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl", "hunyuan_vl_text", "informer",
    "layoutlmv2", "lfm2_moe", "ministral", "moonshine_streaming", "musicgen", "musicgen_melody", "nemotron",
    "omdet-turbo", "pe_audio_video", "pe_audio_video_encoder", "pe_video", "pe_video_encoder", "perception_lm",
    "pp_ocrv6_medium_det", "qwen4_exp", "qwen4_exp_text", "t5gemma2_encoder", "table-transformer",
    "time_series_transformer", "timm_backbone", "timm_wrapper", "torchtitan/qwen3_5", "voxtral_realtime_text",
}

def test_every_family_of_both_zoos_is_described_or_named() -> None:
    started = time.perf_counter()
    audit = layout_audit.run()
    seconds = time.perf_counter() - started
    print(f"audit: {len(audit.built)} families built, {len(audit.unbuildable)} not buildable at their default "
          f"config, {audit.split} parameters split, {audit.whole_fused} fused-named kept whole, "
          f"{len(audit.fallbacks)} fallback kinds named at build; {seconds:.1f} s")
    two_d = {key for key, (_, _, why) in audit.fallbacks.items() if why.startswith("2-D")}
    assert two_d - NOT_SPLIT == set(), sorted(two_d - NOT_SPLIT)  # new: describe it or list it (with docs)
    assert NOT_SPLIT - two_d == set(), sorted(NOT_SPLIT - two_d)  # gone: take it off the list
    assert audit.silent == [], audit.silent[:10]
    assert len(audit.built) > 500, len(audit.built)
    unexpected = {family: why for family, why in audit.unbuildable.items() if family not in NOT_BUILDABLE}
    assert unexpected == {}, unexpected

def test_docs_list_every_weight_kept_whole() -> None:
    docs = (Path(__file__).resolve().parents[4] / "docs" / "fsdp2.md").read_text()
    missing = [key for key in NOT_SPLIT if key.split(".")[0] not in docs]
    assert missing == [], missing
