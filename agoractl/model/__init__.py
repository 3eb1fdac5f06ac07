"""The model: Llama with reparameterized subspace networks (report §4.1), the surrogate, the boundary
codec, the stage partition and stage shapes. torch only; no networking."""
