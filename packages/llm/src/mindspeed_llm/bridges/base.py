"""The bridge contract and its registries.

A bridge is one small class per model family: the Hugging Face architectures it serves, the
config-key table that turns a Hugging Face ``config.json`` into a :class:`ModelShape` and back,
and the parameter rules (:mod:`.rules`). Everything else (planning, sharding, I/O) is generic.
Bridges register with :func:`register_bridge`; :func:`bridge_for_architectures` finds one from
``config.json``'s ``architectures`` and :func:`bridge_for_family` from MindSpeed's
``--model-type-hf`` names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mindspeed.registry import Registry
from mindspeed_llm.bridges.rules import ParamRule
from mindspeed_llm.bridges.shape import ModelShape

_MISSING = object()


@dataclass(frozen=True)
class ConfigKey:
    """One megatron field read from (and written back to) a Hugging Face config key.

    Attributes:
        mg: the :class:`ModelShape` field.
        hf: the config key; dots reach into nested dicts (``rope_parameters.rope_theta``).
        default: value when the key is absent or null; a callable gets the whole config dict.
        negate: the megatron flag is the negation of the config's (``tie_word_embeddings``).
        omit_default: leave the key out of a rebuilt config when it equals the default (for keys
            transformers derives when absent, like ``head_dim``).
    """

    mg: str
    hf: str
    default: Any = _MISSING
    negate: bool = False
    omit_default: bool = False

    def read(self, config: Mapping[str, Any]) -> Any:
        """The megatron value from ``config``; raises ``ValueError`` when required and absent."""
        value = get_path(config, self.hf)
        if value is None:
            if self.default is _MISSING:
                raise ValueError(f"config.json has no {self.hf!r}, which the bridge needs for {self.mg}")
            value = self.default(config) if callable(self.default) else self.default
        return (not value) if self.negate else value

    def write(self, shape: ModelShape, config: dict[str, Any]) -> None:
        """Put the value of ``shape`` back under the config key (left out when it is the default)."""
        value = getattr(shape, self.mg)
        if value is None:
            return
        value = (not value) if self.negate else value
        if self.omit_default and callable(self.default) and value == self.default(config):
            return  # e.g. head_dim == hidden_size / heads: configs that omit it stay without it
        set_path(config, self.hf, value)


def get_path(config: Mapping[str, Any], path: str) -> Any:
    """``config["a"]["b"]`` for ``path == "a.b"``; ``None`` when any level is missing."""
    value: Any = config
    for part in path.split("."):
        if not isinstance(value, Mapping) or value.get(part) is None:
            return None
        value = value[part]
    return value


def set_path(config: dict[str, Any], path: str, value: Any) -> None:
    """Set ``config["a"]["b"] = value`` for ``path == "a.b"``, creating levels as needed."""
    *parents, last = path.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value


#: What each capability means: the part of the project that runs a family's models.
USES = {
    "converts": "convert-ckpt",
    "trains": "training from a Hugging Face directory (checkpoint.load_hf, the RL actor)",
    "infers": "the built-in inference engine (generate, evaluate, the RL rollout)",
}


@dataclass(frozen=True)
class Capabilities:
    """What a family is made of and what the project does with it, declared once by its bridge.

    Every refusal of a family ("not supported yet") reads these; a test checks the architecture
    flags against the family's tiny config and every claimed use against transformers.

    Attributes:
        converts: ``convert-ckpt`` converts its checkpoints (every registered bridge does).
        trains: the trainer builds it from a Hugging Face directory (``checkpoint.load_hf``), and
            so does the RL actor.
        infers: the built-in inference engine runs it.
        moe: it has routed experts.
        shared_experts: its MoE layers have shared experts.
        mla: it uses multi-latent attention.
        mtp: it has multi-token-prediction layers (converted on request).
    """

    converts: bool = True
    trains: bool = True
    infers: bool = True
    moe: bool = False
    shared_experts: bool = False
    mla: bool = False
    mtp: bool = False

    @property
    def features(self) -> tuple[str, ...]:
        """Names of the architecture features the family has (for messages)."""
        names = {
            "moe": "MoE",
            "shared_experts": "shared experts",
            "mla": "multi-latent attention",
            "mtp": "multi-token prediction",
        }
        return tuple(label for name, label in names.items() if getattr(self, name))


def head_dim_default(config: Mapping[str, Any]) -> int:
    """``head_dim`` when the config leaves it out: hidden size over heads."""
    return config["hidden_size"] // config["num_attention_heads"]


class Bridge:
    """Base of the per-family bridges; subclasses fill in the class attributes.

    Attributes:
        family: MindSpeed-LLM's name of the family (``--model-type-hf``), e.g. ``"llama2"``.
        hf_architectures: ``config.json`` ``architectures`` values served.
        hf_model_type: transformers' ``model_type`` (to rebuild a config from megatron args).
        config_keys: the config-key table.
        constants: :class:`ModelShape` fields fixed by the family (``add_qkv_bias=True``).
        requires: config keys that must hold a value (what megatron cannot represent), as
            ``(key, value)``; a missing key counts as holding it.
        rules: the parameter rules.
        hf_stacks: Hugging Face tensors holding every expert of a layer (GPT-OSS), which the
            rules see one expert at a time (:mod:`mindspeed_llm.bridges.stacked`).
        mtp_config_key: the config key counting the checkpoint's multi-token-prediction layers
            (``None``: the family has none); they are converted only on request.
        capabilities: what the family is made of and what the project does with it.
    """

    family: ClassVar[str]
    hf_architectures: ClassVar[tuple[str, ...]]
    hf_model_type: ClassVar[str]
    config_keys: ClassVar[tuple[ConfigKey, ...]] = ()
    constants: ClassVar[Mapping[str, Any]] = {}
    requires: ClassVar[tuple[tuple[str, Any], ...]] = ()
    rules: ClassVar[tuple[ParamRule, ...]] = ()
    mtp_config_key: ClassVar[str | None] = None
    hf_stacks: ClassVar[tuple[Any, ...]] = ()
    capabilities: ClassVar[Capabilities] = Capabilities()

    def shape_from_hf(self, config: Mapping[str, Any]) -> ModelShape:
        """The megatron model described by a Hugging Face config dict.

        Args:
            config: ``config.json`` as transformers normalises it (``PretrainedConfig.to_dict()``).

        Raises:
            ValueError: a required key is missing or a feature megatron cannot represent is on.
        """
        for key, value in self.requires:
            got = get_path(config, key)
            if got is not None and got != value:
                raise ValueError(f"config.json sets {key}={got!r}; the {self.family} bridge supports only {value!r}")
        values = {key.mg: key.read(config) for key in self.config_keys}
        values.update(self.constants)
        values.update(self.shape_extras(config))
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        values.setdefault("params_dtype", str(dtype).removeprefix("torch."))
        if any(str(a).endswith(SEQUENCE_CLASSIFICATION) for a in config.get("architectures") or []):
            # A score head of num_labels rows in the place of the language-model head.
            values["num_labels"] = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
        return ModelShape(**values)

    def shape_extras(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Fields computed from several config keys (MoE layer pattern ...); default none."""
        return {}

    def hf_extras(self, shape: ModelShape) -> dict[str, Any]:
        """Config keys computed from several fields (inverse of :meth:`shape_extras`); default none."""
        return {}

    def hf_config_from_shape(self, shape: ModelShape) -> Any:
        """A transformers config for ``shape`` (used when no ``config.json`` is at hand).

        Returns:
            A ``transformers.PretrainedConfig`` with ``architectures`` and ``dtype`` set.
        """
        from transformers import AutoConfig

        kwargs: dict[str, Any] = {}
        for key in self.config_keys:
            key.write(shape, kwargs)
        for key, value in self.requires:
            set_path(kwargs, key, value)
        kwargs.update(self.hf_extras(shape))
        if shape.num_labels:
            kwargs["num_labels"] = shape.num_labels
        config = AutoConfig.for_model(self.hf_model_type, **kwargs)
        arch = self.hf_architectures[0]
        config.architectures = [score_architecture(arch) if shape.num_labels else arch]
        config.dtype = shape.params_dtype
        return config

    def with_mtp_layers(self, shape: ModelShape, config: Mapping[str, Any], count: int) -> ModelShape:
        """``shape`` with ``count`` multi-token-prediction layers of the checkpoint converted.

        Args:
            shape: the model without them.
            config: the Hugging Face config dict.
            count: how many (``--mtp-num-layers``); 0 converts none.

        Raises:
            ValueError: the family has no such layers, or the checkpoint has fewer.
        """
        if count < 0:
            raise ValueError(f"--mtp-num-layers must be 0 or more, got {count}")
        if not count:
            return dataclasses.replace(shape, mtp_num_layers=None)
        if self.mtp_config_key is None:
            raise ValueError(f"--mtp-num-layers {count}: the {self.family} bridge has no multi-token-prediction layers")
        available = get_path(config, self.mtp_config_key) or 0
        if count > available:
            raise ValueError(
                f"--mtp-num-layers {count}: config.json's {self.mtp_config_key} is {available}; "
                f"pass at most {available}"
            )
        return dataclasses.replace(shape, mtp_num_layers=count)

    def param_rules(self) -> tuple[ParamRule, ...]:
        """The parameter rules (a method so that a family can compose them)."""
        return self.rules

    def __repr__(self) -> str:
        return f"{type(self).__name__}(family={self.family!r})"


#: HF architecture -> bridge class.
BRIDGES: Registry[type[Bridge]] = Registry("model architecture")
#: MindSpeed-LLM family name (``--model-type-hf``) -> bridge class.
FAMILIES: Registry[type[Bridge]] = Registry("model family (--model-type-hf)")


def register_bridge(cls: type[Bridge]) -> type[Bridge]:
    """Class decorator: register ``cls`` under its family and each of its architectures."""
    FAMILIES.register(cls.family, cls)
    for arch in cls.hf_architectures:
        BRIDGES.register(arch, cls)
    return cls


def bridge_for_architectures(architectures: list[str] | None) -> Bridge:
    """The bridge serving the first known entry of ``config.json``'s ``architectures``.

    Raises:
        ValueError: none is registered; the message lists the supported architectures and families.
    """
    for arch in architectures or []:
        arch = causal_architecture(arch)
        if arch in BRIDGES:
            return BRIDGES.get(arch)()
    raise ValueError(
        f"unsupported architecture {', '.join(architectures or ['(none in config.json)'])}; {supported_models()}"
    )


#: The suffix of transformers' sequence-classification heads (a score head on the decoder).
SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def causal_architecture(architecture: str) -> str:
    """The language-model architecture whose decoder ``architecture`` shares
    (``LlamaForSequenceClassification`` -> ``LlamaForCausalLM``; others unchanged)."""
    if architecture.endswith(SEQUENCE_CLASSIFICATION):
        return architecture.removesuffix(SEQUENCE_CLASSIFICATION) + "ForCausalLM"
    return architecture


def score_architecture(architecture: str) -> str:
    """The sequence-classification architecture of a language-model ``architecture`` (the inverse)."""
    return architecture.removesuffix("ForCausalLM") + SEQUENCE_CLASSIFICATION


def supported_models(families: bool = True) -> str:
    """The registered architectures (and families), for error messages."""
    text = f"supported: {', '.join(sorted(map(str, BRIDGES)))}"
    return text + (f" (or pass --model-type-hf, one of {', '.join(sorted(map(str, FAMILIES)))})" if families else "")


def bridge_for_family(family: str) -> Bridge:
    """The bridge of MindSpeed-LLM family name ``family`` (``--model-type-hf``).

    Raises:
        ValueError: unknown family; the message lists the known ones.
    """
    return FAMILIES.get(family)()


def shape_fields() -> set[str]:
    """Names of the :class:`ModelShape` fields (for checking bridge tables)."""
    return {f.name for f in dataclasses.fields(ModelShape)}


def families_with(use: str) -> tuple[str, ...]:
    """The registered families whose bridge declares ``use`` (``converts``, ``trains``, ``infers``),
    in registration order."""
    if use not in USES:
        raise ValueError(f"unknown capability {use!r}; use one of {', '.join(USES)}")
    return tuple(str(family) for family in FAMILIES if getattr(FAMILIES.get(family).capabilities, use))


def require_capability(bridge: Bridge, use: str) -> None:
    """Refuse a family whose bridge does not declare ``use``.

    Raises:
        ValueError: naming the family, what it is made of, and the families that are supported.
    """
    caps = bridge.capabilities
    if getattr(caps, use):
        return
    made_of = f" ({', '.join(caps.features)})" if caps.features else ""
    raise ValueError(
        f"the {bridge.family} family{made_of} is not supported by {USES[use]} yet; supported families: "
        f"{', '.join(families_with(use))}"
    )


#: Shape fields that tell families apart (besides the capability flags), with the value a
#: family that does not set them has.
_DISTINGUISHING = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "add_bias_linear": False,
    "position_embedding_type": "rope",
    "rotary_percent": 1.0,
}


def bridge_for_shape(shape: ModelShape) -> Bridge:
    """The first registered family that writes ``shape`` (for exporting a model trained from scratch).

    A family fits when the shape has its constants (``add_qkv_bias``, ``qk_layernorm`` ...) and
    no other family's (except the fields its config keys set: GLM-4.5 reads its biases and QK
    norm from config.json), and the same MoE / shared-expert / MLA layout as its capabilities.

    Raises:
        ValueError: no family fits; the message lists them.
    """
    bridges = [FAMILIES.get(family)() for family in FAMILIES]
    fields = dict(_DISTINGUISHING)
    for bridge in bridges:
        for name in bridge.constants:
            fields.setdefault(name, _shape_default(name))
    for bridge in bridges:
        caps = bridge.capabilities
        if (caps.moe, caps.shared_experts, caps.mla) != (
            bool(shape.num_experts),
            bool(shape.moe_shared_expert_intermediate_size),
            shape.multi_latent_attention,
        ):
            continue
        free = {key.mg for key in bridge.config_keys} - set(bridge.constants)
        if all(
            getattr(shape, name) == bridge.constants.get(name, default)
            for name, default in fields.items()
            if name not in free
        ):
            return bridge
    raise ValueError(
        f"no model family writes this model (a Llama-style model with RMSNorm, swiglu, rope and no "
        f"linear biases, in the layout of one of {', '.join(map(str, FAMILIES))})"
    )


def _shape_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(ModelShape) if f.name == name)
