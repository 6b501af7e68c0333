"""Engine adapters. Each submodule imports cleanly without its engine installed; the engine is
imported only when an adapter class is first used, and a missing engine is a clear ImportError.
"""
