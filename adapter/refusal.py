"""Refusal: an adapter cannot install as designed (pin drift, a missing module, a broken engine
internal). The installer turns it into a boot stop that names the key to unset. Adapters raise it
from their install(); it lives here, not in the installer, so an adapter never imports the
installer."""


class Refusal(Exception):
    pass
