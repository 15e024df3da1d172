//! Snapshot building, load slots and pairing.

use super::*;
use kvtransfer::{MooncakeBootstrap, MooncakeRank};

fn pod(name: &str, role: &str) -> Pod {
    let mut p = Pod::new(name, "10.0.0.1", 8000).with_label("role-name", role);
    p.name = name.to_string();
    p.ready = true;
    p
}

/// Bootstrap facts of a one-rank Mooncake prefill.
fn bootstrap() -> Option<MooncakeBootstrap> {
    Some(MooncakeBootstrap {
        port: 8998,
        ranks: [(
            0,
            MooncakeRank {
                engine_id: "e".into(),
                worker_addr: Default::default(),
            },
        )]
        .into(),
    })
}

fn build(pods: &[Pod], loads: &LoadTable) -> Snapshot {
    let reg = Registry::with_builtins();
    let unhealthy = BTreeSet::from(["sick".to_string()]);
    let inputs = SnapshotInputs {
        registry: &reg,
        default_connector: "shfs",
        default_models: &["m".to_string()],
        unhealthy: &unhealthy,
        roleset_pairing: false,
        adapters: &std::collections::BTreeMap::new(),
    };
    build_snapshot(pods, &inputs, loads)
}

#[test]
fn filters_and_resolves() {
    let mut not_ready = pod("nr", "prefill");
    not_ready.ready = false;
    let mut no_ip = pod("noip", "decode");
    no_ip.ip = None;
    let mooncake_without_bootstrap =
        pod("mc", "prefill").with_label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER, "Mooncake ");
    let mut mooncake = pod("mc2", "prefill")
        .with_label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER, "mooncake")
        .with_label("model.aibrix.ai/name", "a, b");
    mooncake.mooncake_bootstrap = bootstrap();
    let pods = vec![
        pod("p1", "prefill"),
        not_ready,
        no_ip,
        mooncake_without_bootstrap,
        mooncake,
        pod("sick", "decode"),
        pod("d1", "decode").with_label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER, "NIXL"),
        pod("both", "worker"),
        pod("p1", "prefill"),
    ];
    let loads = LoadTable::default();
    let snap = build(&pods, &loads);
    let names: Vec<_> = snap.prefill.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["p1", "mc2"]);
    assert_eq!(snap.prefill[0].connector.as_deref(), Some("shfs"));
    assert_eq!(snap.prefill[1].connector.as_deref(), Some("mooncake"));
    assert_eq!(snap.prefill[1].models, ["a", "b"]);
    assert_eq!(snap.decode.len(), 1);
    assert_eq!(snap.decode[0].connector.as_deref(), Some("nixl"));
    assert_eq!(snap.models, ["a", "b", "m"]);
    assert_eq!(snap.excluded.len(), 6);
    // shfs/mooncake prefills cannot pair with a nixl-only decode.
    assert!(!snap.has_routable_pair());
}

#[test]
fn unlabelled_decodes_have_the_default_connector_and_unknown_labels_are_excluded() {
    let mut mooncake_prefill =
        pod("mc", "prefill").with_label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER, "mooncake");
    mooncake_prefill.mooncake_bootstrap = bootstrap();
    let pods = vec![
        mooncake_prefill,
        pod("d", "decode"),
        pod("typo", "decode").with_label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER, "moon"),
    ];
    let snap = build(&pods, &LoadTable::default());
    // The unlabelled decode speaks the default (shfs): it does not pair with mooncake.
    assert_eq!(snap.decode.len(), 1);
    assert_eq!(snap.decode[0].connector.as_deref(), Some("shfs"));
    assert!(!snap.has_routable_pair());
    let (name, why) = &snap.excluded[0];
    assert_eq!(name, "typo");
    assert!(
        why.contains("\"moon\"") && why.contains("mooncake"),
        "{why}"
    );
}

#[test]
fn encoders_are_their_own_role_without_a_connector() {
    let pods = vec![
        pod("p", "prefill"),
        pod("d", "decode"),
        // An encoder's connector label is not read (a typo does not exclude it).
        pod("e1", "encode").with_label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER, "none"),
        pod("e2", "encode").with_label("model.aibrix.ai/name", "vision"),
        pod("combined", "worker"),
    ];
    let snap = build(&pods, &LoadTable::default());
    let names: Vec<_> = snap.encode.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["e1", "e2"]);
    assert!(
        snap.encode
            .iter()
            .all(|e| e.connector.is_none() && e.agent.is_none())
    );
    assert_eq!(snap.encode[0].role.as_str(), "encode");
    assert!(snap.encode[1].serves(Some("vision")) && !snap.encode[1].serves(Some("m")));
    // Encoders change nothing of prefill/decode pairing.
    assert!(snap.has_routable_pair() && snap.every_pair);
    assert_eq!(snap.excluded.len(), 1, "{:?}", snap.excluded);
    assert_eq!(Role::of_label(Some("encode")), Some(Role::Encode));
    assert_eq!(Role::of_label(Some("Encode")), None);
}

#[test]
fn loads_survive_rebuilds_and_drain() {
    let loads = LoadTable::default();
    let snap = build(&[pod("p", "prefill"), pod("d", "decode")], &loads);
    assert!(snap.has_routable_pair());
    let guard = LoadGuard::acquire(&snap.decode[0].load);
    let again = build(&[pod("p", "prefill"), pod("d", "decode")], &loads);
    assert_eq!(again.decode[0].load.in_flight(), 1);
    // The endpoint leaves; its counter stays reachable while a request holds it.
    let gone = build(&[pod("p", "prefill")], &loads);
    assert!(gone.decode.is_empty());
    drop(guard);
    assert_eq!(again.decode[0].load.in_flight(), 0);
}

/// The one-connector shortcut answers as the labels do, in fleets where it applies and
/// where it must not.
#[test]
fn the_every_pair_shortcut_agrees_with_the_labels() {
    let label = |p: Pod, c: &str| p.with_label(kvtransfer::CONNECTOR_TYPE_IDENTIFIER, c);
    let fleets = [
        vec![
            pod("p1", "prefill"),
            pod("p2", "prefill"),
            pod("d1", "decode"),
        ],
        vec![
            label(pod("p1", "prefill"), "nixl"),
            label(pod("d1", "decode"), "nixl"),
        ],
        // The unlabelled decode has the default connector (shfs).
        vec![
            label(pod("p1", "prefill"), "nixl"),
            label(pod("p2", "prefill"), "nixl"),
            label(pod("d1", "decode"), "nixl"),
            pod("d2", "decode"),
        ],
        vec![
            pod("p1", "prefill"),
            label(pod("p2", "prefill"), "nixl"),
            label(pod("d1", "decode"), "nixl"),
            pod("d2", "decode"),
        ],
    ];
    for (i, pods) in fleets.iter().enumerate() {
        let snap = build(pods, &LoadTable::default());
        assert_eq!(snap.every_pair, i < 2, "fleet {i}");
        for p in &snap.prefill {
            for d in &snap.decode {
                assert_eq!(snap.pairs(p, d), snap.pairs_by_labels(p, d), "fleet {i}");
            }
        }
    }
}

#[test]
fn live_endpoints_have_distinct_slots_reused_once_gone() {
    let loads = LoadTable::default();
    let pods = |names: &[&str]| -> Vec<Pod> { names.iter().map(|n| pod(n, "prefill")).collect() };
    let slots =
        |snap: &Snapshot| -> Vec<usize> { snap.prefill.iter().map(|e| e.load.slot()).collect() };
    let snap = build(&pods(&["a", "b", "c"]), &loads);
    assert_eq!(slots(&snap), [0, 1, 2]);
    drop(snap);
    // b leaves; d takes its slot, a and c keep theirs.
    let snap = build(&pods(&["a", "c"]), &loads);
    drop(snap);
    let snap = build(&pods(&["a", "c", "d"]), &loads);
    assert_eq!(slots(&snap), [0, 2, 1]);
    // A counter held by a request keeps its slot while the endpoint is away.
    let held = snap.prefill[0].load.clone();
    drop(snap);
    let snap = build(&pods(&["c", "d", "e"]), &loads);
    assert_eq!(slots(&snap), [2, 1, 3]);
    assert_eq!(held.slot(), 0);
}

#[test]
fn roleset_pairing_pairs_within_a_roleset_only() {
    let reg = Registry::with_builtins();
    let unhealthy = BTreeSet::new();
    let inputs = SnapshotInputs {
        registry: &reg,
        default_connector: "shfs",
        default_models: &[],
        unhealthy: &unhealthy,
        roleset_pairing: true,
        adapters: &std::collections::BTreeMap::new(),
    };
    let pods = [
        pod("p-a", "prefill").with_label("roleset-name", "a"),
        pod("d-b", "decode").with_label("roleset-name", "b"),
        pod("p-none", "prefill"),
    ];
    let loads = LoadTable::default();
    let snap = build_snapshot(&pods, &inputs, &loads);
    assert!(!snap.has_routable_pair());
    let pods = [
        pod("p-a", "prefill").with_label("roleset-name", "a"),
        pod("d-a", "decode").with_label("roleset-name", "a"),
    ];
    let snap = build_snapshot(&pods, &inputs, &loads);
    assert!(snap.pairs(&snap.prefill[0], &snap.decode[0]));
}

#[test]
fn a_data_parallel_engine_is_one_endpoint_per_rank() {
    let ranked = |name: &str, role: &str, size: &str| {
        let mut p = pod(name, role);
        p.annotations
            .insert(ranks::DATA_PARALLEL_SIZE_ANNOTATION.into(), size.into());
        p
    };
    // "sick#dp1" is unhealthy: that rank alone leaves the snapshot.
    let pods = vec![
        ranked("p", "prefill", "4"),
        ranked("sick", "decode", "2"),
        ranked("bad", "decode", "0"),
        pod("d", "decode"),
    ];
    let reg = Registry::with_builtins();
    let unhealthy = BTreeSet::from(["sick#dp1".to_string()]);
    let inputs = SnapshotInputs {
        registry: &reg,
        default_connector: "shfs",
        default_models: &[],
        unhealthy: &unhealthy,
        roleset_pairing: false,
        adapters: &std::collections::BTreeMap::new(),
    };
    let loads = LoadTable::default();
    let snap = build_snapshot(&pods, &inputs, &loads);
    let names = |eps: &[Arc<Endpoint>]| -> Vec<(String, Option<u32>)> {
        eps.iter().map(|e| (e.name.clone(), e.rank)).collect()
    };
    assert_eq!(
        names(&snap.prefill),
        (0..4)
            .map(|r| (format!("p#dp{r}"), Some(r)))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        names(&snap.decode),
        vec![("sick#dp0".to_string(), Some(0)), ("d".to_string(), None)]
    );
    // Each rank has its own load counter; all name the engine's pod.
    let slots: BTreeSet<usize> = snap.prefill.iter().map(|e| e.load.slot()).collect();
    assert_eq!(slots.len(), 4);
    assert!(snap.prefill.iter().all(|e| e.engine_name() == "p"));
    assert_eq!(snap.prefill[2].target().rank, Some(2));
    let why = |name: &str| {
        snap.excluded
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, w)| w.clone())
    };
    assert_eq!(why("sick#dp1").as_deref(), Some("unhealthy"));
    assert!(why("bad").is_some_and(|w| w.contains("data-parallel-size")));
}

#[test]
fn adapters_route_only_to_their_holders() {
    let reg = Registry::with_builtins();
    let held = |names: &[&str]| -> adapters::AdapterParents {
        names
            .iter()
            .map(|a| ((*a).to_string(), "m".to_string()))
            .collect()
    };
    let learned: BTreeMap<String, adapters::AdapterParents> = [
        ("p1".to_string(), held(&["sql"])),
        ("d1".to_string(), held(&["sql", "chat"])),
        // Not routable: its adapter is no adapter of the fleet.
        ("sick".to_string(), held(&["gone"])),
    ]
    .into();
    let inputs = SnapshotInputs {
        registry: &reg,
        default_connector: "shfs",
        default_models: &["m".to_string()],
        unhealthy: &BTreeSet::from(["sick".to_string()]),
        roleset_pairing: false,
        adapters: &learned,
    };
    let pods = [
        pod("p1", "prefill"),
        pod("p2", "prefill"),
        pod("d1", "decode"),
        pod("sick", "decode"),
    ];
    let snap = build_snapshot(&pods, &inputs, &LoadTable::default());
    assert_eq!(
        snap.adapters.keys().collect::<Vec<_>>(),
        ["chat", "sql"],
        "the union over routable endpoints"
    );
    assert_eq!(snap.adapter_parent("sql"), Some("m"));
    assert_eq!(snap.adapter_parent("m"), None);
    let (p1, p2, d1) = (&snap.prefill[0], &snap.prefill[1], &snap.decode[0]);
    assert!(p1.serves(Some("sql")) && d1.serves(Some("sql")));
    assert!(
        !p2.serves(Some("sql")),
        "a base-model endpoint without the adapter"
    );
    assert!(
        p2.serves(Some("m")) && p1.serves(Some("m")),
        "the base model everywhere"
    );
    assert!(
        !p1.serves(Some("gone")),
        "not an adapter: the models decide"
    );
    assert!(!snap.same_models, "endpoints differ in adapters");
    assert!(!snap.all_serve(Some("chat")));
}

#[test]
fn a_snapshots_own_lists_have_their_loads_in_order() {
    let loads = LoadTable::default();
    let pods = [
        pod("p1", "prefill"),
        pod("d1", "decode"),
        pod("p2", "prefill"),
        pod("d2", "decode"),
    ];
    let snap = build(&pods, &loads);
    for list in [&snap.prefill, &snap.decode] {
        let own = snap.loads_of(list).expect("the snapshot's own list");
        assert_eq!(own.len(), list.len());
        assert!(own.iter().zip(list).all(|(l, e)| Arc::ptr_eq(l, &e.load)));
    }
    // Any other list (a copy, a part, another snapshot's) has none: its order is not known.
    let copy = snap.decode.clone();
    assert!(snap.loads_of(&copy).is_none());
    assert!(snap.loads_of(&snap.decode[..1]).is_none());
    let unindexed = Snapshot {
        decode: snap.decode.clone(),
        ..Snapshot::default()
    };
    assert!(unindexed.loads_of(&unindexed.decode).is_none());
}
