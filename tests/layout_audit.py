"""Every model family of the installed `transformers` and torchtitan, built at its default config on
the `meta` device (structure only), routed for Muon: which weights the table splits, which it
keeps whole, and which go by a fallback (params/groups.py: routing_fallbacks).

Weight initialization is skipped while building (torch.nn.init's functions do nothing): on `meta`
it only costs time.
"""

import contextlib
import warnings
from dataclasses import dataclass, field

import torch

from megatron_eopt import OptimizerConfig
from megatron_eopt.params.groups import ParamRouting, build_param_groups, matrix_layouts, routing_fallbacks

CONFIG = OptimizerConfig(optimizer="muon", lr=0.01)
ROUTING = ParamRouting("muon", "hidden_matrices", "adam", matrix_batches=True)


@dataclass
class Audit:
    built: list = field(default_factory=list)
    unbuildable: dict = field(default_factory=dict)  # family -> why
    split: int = 0  # parameters Muon orthogonalizes as several matrices
    whole_fused: int = 0  # named like a fused weight, or described by the table, and one matrix
    fallbacks: dict = field(default_factory=dict)  # "Owner.attribute" -> (first family, fqn, why)
    silent: list = field(default_factory=list)  # N-D tensors sent to the scalar optimizer without a word


# Why the scalar optimizer may step an N-D tensor without naming it at build: it is no matrix.
QUIET_N_D = ("convolution kernel", "per-expert vectors")


@contextlib.contextmanager
def _no_init():
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, function in saved.items():
            setattr(torch.nn.init, n, function)


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:100]}"


LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers", "depth")
MAX_LAYERS = 4  # enough for every kind of layer a default config mixes (checked: the same findings as all layers)


def _fewer_layers(config):
    """`config` (and its sub-configs) with at most MAX_LAYERS layers per stack: building is most of the
    audit's time, and layers repeat. Layer-type lists stay as they are (a model reads their first
    entries)."""
    for name in LAYER_COUNTS:
        value = getattr(config, name, None) if name in getattr(config, "__dict__", {}) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LAYERS:
            setattr(config, name, MAX_LAYERS)
    for value in list(getattr(config, "__dict__", {}).values()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _fewer_layers(value)
    return config


def route(family: str, model: torch.nn.Module, audit: Audit) -> None:
    from megatron_eopt.params.fused_layouts import FUSED_NAME

    _, records = build_param_groups([model], CONFIG, {}, (), ROUTING)
    muon = [r for r in records if r.optimizer_name == "muon"]
    fallbacks = routing_fallbacks(records, [model], "muon")
    for fqn, why in fallbacks.items():
        owner_attribute = why.split("(")[-1].split()[-1].rstrip(")") if why.startswith("N-D") else why.split()[1]
        audit.fallbacks.setdefault(owner_attribute, (family, fqn, why))
    for r in records:
        quiet = r.routed_because.startswith(QUIET_N_D) or "a vector" in r.routed_because
        if r.param.dim() > 2 and r.optimizer_name != "muon" and not quiet and r.fqn not in fallbacks:
            audit.silent.append((family, r.fqn, r.routed_because))
    for fqn, layout in matrix_layouts(muon, [model], 1, True).items():
        matrices = len(layout.global_block_shapes()) if layout.batch is None else layout.batch.count
        if layout.batch is not None or matrices > 1 or len(layout.blocks) > 1:
            audit.split += 1
        elif FUSED_NAME.search(fqn.rsplit(".", 2)[-2] if fqn.endswith(".weight") else fqn.rsplit(".", 1)[-1]):
            audit.whole_fused += 1
    audit.built.append(family)


def transformers_families(audit: Audit) -> None:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    for family, class_name in sorted(MODEL_MAPPING_NAMES.items()):
        class_name = class_name[0] if isinstance(class_name, (list, tuple)) else class_name
        model = _build(transformers, class_name, CONFIG_MAPPING[family], audit, family)
        if model is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                route(f"transformers/{family}", model, audit)


def _build(transformers, class_name: str, config_class, audit: Audit, family: str):
    """The family's model on `meta`, with fewer layers, else (a config that needs all of them,
    Gemma 4's shared KV layers) at its full default config; None where neither builds."""
    why = ""
    for shrink in (_fewer_layers, lambda config: config):
        try:
            with warnings.catch_warnings(), _no_init(), torch.device("meta"):
                warnings.simplefilter("ignore")
                return getattr(transformers, class_name)(shrink(config_class()))
        except Exception as error:  # a default config some families cannot build from (optional packages)
            why = _first_line(error)
    audit.unbuildable[family] = why
    return None


TORCHTITAN_FAMILIES = {"llama3": "llama3_configs", "qwen3": "qwen3_configs", "qwen3_5": "qwen3_5_configs",
                       "deepseek_v3": "deepseekv3_configs", "kimi_k2_7": "kimi_k2_5_configs",
                       "gpt_oss": "gptoss_configs", "muse_glimmer": "muse_glimmer_configs", "flux": "flux_configs"}


def torchtitan_families(audit: Audit) -> None:
    """Each torchtitan model family's debug flavors (its first flavor where it has none). All its
    flavors, full sizes included, gave the same findings (measured), in 30 s more."""
    import importlib

    for family, table in TORCHTITAN_FAMILIES.items():
        try:
            package = importlib.import_module(f"torchtitan.models.{family}")
        except ImportError as error:  # an optional package it needs
            audit.unbuildable[f"torchtitan/{family}"] = f"{type(error).__name__}: {error}"
            continue
        for flavor in [f for f in getattr(package, table) if "debug" in f] or list(getattr(package, table))[:1]:
            name = f"torchtitan/{family}/{flavor}"
            try:
                with warnings.catch_warnings(), _no_init(), torch.device("meta"):
                    warnings.simplefilter("ignore")
                    model = package.model_registry(flavor).model.build()  # its defaults (attention backend, ...)
            except Exception as error:
                audit.unbuildable[name] = _first_line(error)
                continue
            route(name, model, audit)


def run() -> Audit:
    audit = Audit()
    torchtitan_families(audit)
    transformers_families(audit)
    return audit
