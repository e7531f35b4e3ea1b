"""Groups over HTTP: the wire schemas (`schemas`), the group service that creates and reads them
(`service`) and the RULER scorer that judges them in the background (`scorer`).

The group life cycle itself (states, transitions, leases) is the store's: store/groups.py.
"""
