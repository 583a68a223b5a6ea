"""CPU kernels: C sources in `csrc/`, compiled on first use, and their torch wrappers."""
