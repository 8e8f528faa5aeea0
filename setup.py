"""tidegraph: elastic continuous training of temporal graph neural networks on Ray."""

from setuptools import find_packages, setup

setup(
    name="tidegraph",
    version="0.1.0",
    description="Ray-based elastic training orchestrator for temporal graph neural networks",
    python_requires=">=3.10",
    packages=find_packages(include=["tidegraph", "tidegraph.*"]),
    package_data={"tidegraph.data": ["*.csv.gz", "*.txt.gz", "README.md"]},
    include_package_data=True,
    install_requires=[
        # 2.13.0 (this project's CPU machines) and 2.11 (the GPU machine) both satisfy this.
        "torch>=2.4,<2.14",
        "numpy>=1.24",
        "pyarrow>=14",
        "ray[default]>=2.40",
        "prometheus-client>=0.17",
        "pyyaml>=6",
    ],
    extras_require={
        # the report's tests render its figures (`report`); serving's run Ray Serve (`serve`);
        # the TGB protocol's are checked against py-tgb's own code (its negative generator
        # imports torch_geometric), a reference in tests, not a dependency of the package
        "test": [
            "pytest>=8",
            "hypothesis>=6.100",
            "ruff>=0.5",
            "matplotlib>=3.7",
            "ray[serve]>=2.40",
            "py-tgb>=2.0",
            "torch_geometric>=2.3",
        ],
        "report": ["matplotlib>=3.7"],
        "serve": ["ray[serve]>=2.40"],
    },
    entry_points={
        "console_scripts": [
            "tidegraph-train=tidegraph.jobs.train:main",
            "tidegraph-serve=tidegraph.jobs.serve:main",
        ]
    },
)
