"""amp_lab's search sweeper: Hydra finds it in the `hydra_plugins` namespace package."""
