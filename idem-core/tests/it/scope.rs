//! Scopes and record ids: field boundaries, hex, blank principals.

use idem_core::{Endpoint, RecordId, Scope, ScopeError};
use proptest::prelude::*;

#[test]
fn field_splits_do_not_collide() {
    assert_ne!(RecordId::derive("ab", "c", "k"), RecordId::derive("a", "bc", "k"));
    assert_ne!(RecordId::derive("p", "ab", "c"), RecordId::derive("p", "a", "bc"));
    assert_ne!(RecordId::derive("", "pk", ""), RecordId::derive("p", "k", ""));
}

#[test]
fn empty_principal_is_refused() {
    assert_eq!(Scope::new("", Endpoint::new("POST", "/x")), Err(ScopeError::BlankPrincipal));
}

#[test]
fn hex_round_trips() {
    let id = RecordId::derive("p", "e", "k");
    assert_eq!(RecordId::from_hex(&id.to_hex()), Some(id));
    assert_eq!(RecordId::from_hex("zz"), None);
}

proptest! {
    #[test]
    fn distinct_triples_give_distinct_ids(
        a in (".{0,8}", ".{0,8}", ".{0,8}"),
        b in (".{0,8}", ".{0,8}", ".{0,8}"),
    ) {
        prop_assume!(a != b);
        prop_assert_ne!(RecordId::derive(&a.0, &a.1, &a.2), RecordId::derive(&b.0, &b.1, &b.2));
    }

    #[test]
    fn moving_bytes_between_fields_changes_the_id(s in "[a-z]{2,12}", cut1 in 0usize..12, cut2 in 0usize..12) {
        let c1 = cut1.min(s.len());
        let c2 = cut2.min(s.len());
        prop_assume!(c1 != c2);
        let x = RecordId::derive(&s[..c1], &s[c1..], "k");
        let y = RecordId::derive(&s[..c2], &s[c2..], "k");
        prop_assert_ne!(x, y);
    }
}
