"""What the rooms hand each other: the records a rank tells its launcher, with their one
wire format (``events``), and the typed results the tasks pass on and the flow returns
(``results``). Torch-free."""
