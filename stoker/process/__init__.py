"""How a stoker process lives, ends and connects: the lifeline that ends it with its launcher
(``lifeline``), the end of a torch process without the interpreter's teardown
(``quick_exit``), and the connection to a Ray cluster (``ray_connect``). Torch-free."""
