"""PivotRL: RL post-training with generative reward models, shifting GPUs between roles at run time.

Subpackages follow the paper's sections: ``scheduler`` (§6), ``planner`` (§7), ``gps`` (§5.1, App. B),
``shifting`` (§5.2), ``roles`` (§2.1, §8.1), ``sim`` (the cluster simulator). The pure cores (``scheduler``, ``planner``, ``gps.layout``,
``gps.placement``, ``gps.plan``, ``sim``) import neither torch nor vLLM.
"""

__version__ = "0.1.0"
