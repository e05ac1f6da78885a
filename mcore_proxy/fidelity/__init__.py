"""Fidelity of a proxy against its original on the same tokens (`mcore-proxy fidelity`)."""
