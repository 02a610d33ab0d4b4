"""nodes: the only part of the pack that imports `comfy` / `comfy_api`.

`entry` (the V3 extension and activation), `state` (this rank's TP state), `patches` (every change the pack makes
to ComfyUI), `loader` (the UNETLoader hook), `parallel` (roles and row-parallel calls on ComfyUI's linears),
`prompt_lifecycle` (each prompt a run on every rank), `run` (the rendezvous each TP step starts with),
`model_wrappers` (the sampler's rendezvous, rank 0's inputs at each model call), `vae_decode` and `text_encoder`
(the decode and the encode split over the ranks), `pack_nodes` (the status and conditioning nodes). Each file is
thin over `tp2` and `kernels`.
"""
