"""Position policies: how documents become training rows, one registered
class each (docs/data.md, "Position policies").

`register` adds a policy (a `Policy` subclass) from anywhere, `get` looks one
up by its data.position_policy name, `names` lists them. The built-in ones
are registered when this package is imported.
"""

from flax_posemb.data.policies import crops
from flax_posemb.data.policies import document
from flax_posemb.data.policies import packed
from flax_posemb.data.policies.exposure import CorpusLengths
from flax_posemb.data.policies.exposure import Exposure
from flax_posemb.data.policies.registry import Policy
from flax_posemb.data.policies.registry import ShortPhase
from flax_posemb.data.policies.registry import get
from flax_posemb.data.policies.registry import names
from flax_posemb.data.policies.registry import register

__all__ = [
    'CorpusLengths',
    'Exposure',
    'Policy',
    'ShortPhase',
    'crops',
    'document',
    'get',
    'names',
    'packed',
    'register',
]
