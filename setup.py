from setuptools import find_packages, setup

DOCS = [
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.1",
    "mkdocstrings==1.0.8",
    "mkdocstrings-python==2.0.11",
    "matplotlib>=3.7,<4",
]

# Every floor below is tested on a subset of the suite: `nox -s floor` runs 8 of its test files (noxfile.py
# FAST_SUBSET) on the oldest admitted release of each (FLOOR), `nox -s newest` on the newest on PyPI; `make test`
# runs the whole suite on the pinned set only (docs/compatibility.md says what the subset covers).
# transformers 5.3 is the first 5.x whose Trainer has what the integration relies on (_run_epoch, ...).
TRANSFORMERS = ["transformers>=5.3,<6", "trl>=1.0,<2"]
# The DeepSpeed release tests/test_deepspeed.py ran against (`make test` installs it): an sdist, built without a
# compiler (no ops are prebuilt; the test runs none of DeepSpeed's compiled ops).
DEEPSPEED = "deepspeed==0.19.8"
# Object-store streaming datasets read by index (accelerate_stateful.Indexed, docs/sources/streaming.md), the
# releases tests/test_object_store_sources.py ran against. Their own requirements would replace torch, numpy and
# transformers here (mosaicml-streaming 0.13 pins numpy<2.2 and transformers<5), so `make test` installs them
# --no-deps with the few modules their imports need.
STREAMING = ["mosaicml-streaming==0.13.0", "litdata==0.2.76", "webdataset==1.0.2"]
STREAMING_IMPORTS = ["torchvision==0.28.0", "brotli==1.2.1", "python-snappy==0.7.3", "zstd==1.5.7.2",
                     "catalogue==2.0.10", "lightning-utilities==0.15.3", "boto3==1.44.8", "braceexpand==0.1.7"]
# The Accelerate release `make test` and the conformance run (tools/accelerate_conformance.py) pin.
PINNED = ["accelerate==1.15.0", "torchdata==0.11.0", "safetensors==0.8.0"]

setup(
    name="accelerate-stateful",
    version="0.1.0",
    description="Exact, replay-free mid-epoch resume for Hugging Face Accelerate data loaders.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["accelerate_stateful", "accelerate_stateful.*"]),
    python_requires=">=3.9",
    install_requires=[
        # Pinned set (make test): torch 2.13, accelerate 1.15, torchdata 0.11, safetensors 0.8.
        "torch>=2.6",
        # 1.8 is the first whose load_state takes load_kwargs.
        "accelerate>=1.8,<2",
        "torchdata>=0.10",
        "safetensors>=0.4.3",
    ],
    entry_points={"console_scripts": ["accelerate-stateful = accelerate_stateful.cli:main"]},
    extras_require={
        # `make docs`: the site (mkdocs.yml), its API reference, and the figures (benchmarks/plot.py).
        "docs": DOCS,
        # accelerate_stateful.transformers (StatefulTrainer, stateful(SFTTrainer)); pinned: 5.23 and trl 1.16.
        "transformers": TRANSFORMERS,
        # `make test` runs DeepSpeed ZeRO-0..3 for real on 2 CPU processes (tests/test_deepspeed.py) with this release.
        "deepspeed": [DEEPSPEED],
        # mosaicml-streaming, litdata and webdataset at the tested releases (install with --no-deps: see STREAMING).
        "streaming": [*STREAMING, *STREAMING_IMPORTS],
        # `nox -s conformance`: Accelerate's own tests (fetched from its sdist at run time) with our Accelerator.
        "conformance": ["pytest>=8", "pytest-timeout>=2.3", "parameterized", "psutil", "datasets>=4.7", *PINNED],
        # `make test` pins the integrations to the versions the suite was written against; pytest-codeblocks
        # reads the docs' code blocks for tests/test_docs_blocks.py.
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "pytest-codeblocks>=0.18", "datasets>=4.7",
                 *DOCS, *PINNED, "transformers==5.23.0", "trl==1.16.0", *STREAMING_IMPORTS],
    },
)
