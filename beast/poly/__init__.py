"""PolyBeast's operations, one door away from polybeast.py's learner: addresses (the address
formats, which server each actor streams from), layout (the server flags, their defaults and
checks), local_servers (the env servers a learner starts on its own machine),
acting_process (the actor pool and inference in a process of their own, and its failures).
"""
