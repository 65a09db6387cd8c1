from setuptools import find_packages, setup

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
    extras_require={
        # accelerate_stateful.transformers (StatefulTrainer, stateful(SFTTrainer)); tested with 5.23 and trl 1.16.
        "transformers": ["transformers>=5.0,<6", "trl>=1.0,<2"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "datasets>=3.0", "transformers>=5.0,<6", "trl>=1.0,<2"],
    },
)
