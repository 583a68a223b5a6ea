"""Speculative decoding: n-gram and draft-model proposers, acceptance, and the policy
that turns it on and off. Its settings are in `pdserve.common.speculative`."""
