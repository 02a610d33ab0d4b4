"""nodes: the only part of the pack that imports `comfy` / `comfy_api`.

`entry` (the V3 extension and activation), `state` (this rank's TP state), `loader` (the UNETLoader hook),
`parallel` (roles and row-parallel calls on ComfyUI's linears), `lockstep` (prompt rendezvous and input
broadcast), `vae_decode` (the H3 video decode split over the ranks), `pack_nodes` (the status and conditioning
nodes). Each file is thin over `tp2` and `kernels`.
"""
