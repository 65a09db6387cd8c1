from setuptools import find_packages, setup

DOCS = [
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.1",
    "mkdocstrings==1.0.8",
    "mkdocstrings-python==2.0.11",
    "matplotlib>=3.7,<4",
]

TRANSFORMERS = ["transformers>=5.0,<6", "trl>=1.0,<2"]

setup(
    name="accelerate-stateful",
    version="0.1.0",
    description="Exact, replay-free mid-epoch resume for Hugging Face Accelerate data loaders.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["accelerate_stateful", "accelerate_stateful.*"]),
    python_requires=">=3.9",
    install_requires=[
        # Tested with torch 2.13, accelerate 1.15, torchdata 0.11, safetensors 0.8.
        "torch>=2.4",
        "accelerate>=1.4,<2",
        "torchdata>=0.10",
        "safetensors>=0.4",
    ],
    entry_points={"console_scripts": ["accelerate-stateful = accelerate_stateful.cli:main"]},
    extras_require={
        # `make docs`: the site (mkdocs.yml), its API reference, and the figures (benchmarks/plot.py).
        "docs": DOCS,
        # accelerate_stateful.transformers (StatefulTrainer, stateful(SFTTrainer)); tested with 5.23 and trl 1.16.
        "transformers": TRANSFORMERS,
        # `make test` pins the integrations to the versions the suite was written against.
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "datasets>=3.0", *DOCS, "transformers==5.23.0", "trl==1.16.0"],
    },
)
