"""HTTP services: the verifier and reward-model scorers behind ``honing serve``."""
