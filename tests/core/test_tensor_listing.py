"""`TensorListing` against the receivers' side of the same protocol (`Manifests`): whatever
path each update takes, the sender names the list by digest only where the receivers hold it,
so no update is refused for a digest they do not know."""

from wtransfer.manifest import Manifest, Manifests
from wtransfer.packing import TensorMeta
from wtransfer.trainer.listing import TensorListing

FIRST = Manifest([TensorMeta("a", "float32", (4,))])
SECOND = Manifest([TensorMeta("a", "float32", (4,)), TensorMeta("b", "bfloat16", (2, 2))])


def update(listing, receivers, manifest, *, in_full=False, lands=True):
    """One update of `manifest`'s list, named through `fields` (or sent whole by a path that
    cannot name it by digest: `in_full`); the fields it carried."""
    listing.update_started()
    if in_full:
        listing.sent(manifest)
        fields = {"tensors": manifest.wire}
    else:
        fields = listing.fields(manifest)
    held = receivers.resolve(fields.get("tensors"), fields.get("tensors_digest"))
    assert held.digest == manifest.digest
    if lands:
        listing.update_landed()
    return fields


def test_an_unchanged_list_travels_by_digest_after_it_landed():
    listing, receivers = TensorListing(), Manifests()
    assert update(listing, receivers, FIRST) == {"tensors": FIRST.wire}
    assert update(listing, receivers, FIRST) == {"tensors_digest": FIRST.digest}


def test_a_list_sent_in_full_by_another_path_is_the_one_held():
    """A staged update of another list (sent whole) between two of the first: the next
    update of the first sends it whole, since the receivers hold the other; then the
    digest again. (`update` fails on a digest the receivers do not know.)"""
    listing, receivers = TensorListing(), Manifests()
    update(listing, receivers, FIRST)
    update(listing, receivers, SECOND, in_full=True)
    assert update(listing, receivers, FIRST) == {"tensors": FIRST.wire}
    assert update(listing, receivers, FIRST) == {"tensors_digest": FIRST.digest}
    update(listing, receivers, FIRST, in_full=True)
    assert update(listing, receivers, FIRST) == {"tensors_digest": FIRST.digest}


def test_a_failed_update_sends_the_list_whole_next_time():
    listing, receivers = TensorListing(), Manifests()
    update(listing, receivers, FIRST)
    update(listing, receivers, FIRST, lands=False)
    assert update(listing, receivers, FIRST) == {"tensors": FIRST.wire}
