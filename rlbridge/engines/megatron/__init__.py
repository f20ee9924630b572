"""The megatron trainer engine: megatron-core models loaded through Megatron-Bridge (or mbridge).

Importing this package imports nothing heavy; `MegatronTrainEngine` lives in `.engine`, the recipe ->
provider mapping table in `.provider`, the no-Transformer-Engine / CPU compatibility layer in `.compat`.
"""
