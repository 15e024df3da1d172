//! Tests of the pure pod -> endpoint mapping.

use super::*;
use crate::config::{POD_GROUP_INDEX_LABEL, PORT_LABEL};
use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

/// A Ready pod with an IP and the given labels.
fn pod(name: &str, ip: &str, labels: &[(&str, &str)]) -> KubePod {
    KubePod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some("llm".to_owned()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        spec: None,
        status: Some(PodStatus {
            phase: Some("Running".to_owned()),
            pod_ip: Some(ip.to_owned()),
            conditions: Some(vec![
                condition("PodScheduled", "True"),
                condition("Ready", "True"),
            ]),
            ..PodStatus::default()
        }),
    }
}

fn condition(type_: &str, status: &str) -> PodCondition {
    PodCondition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        ..PodCondition::default()
    }
}

fn set_ready(p: &mut KubePod, ready: &str) {
    if let Some(s) = p.status.as_mut() {
        s.conditions = Some(vec![condition("Ready", ready)]);
    }
}

fn prefill(name: &str, ip: &str) -> KubePod {
    pod(
        name,
        ip,
        &[
            ("role-name", "prefill"),
            ("roleset-name", "rs-a"),
            ("model.aibrix.ai/name", "llama"),
            ("model.aibrix.ai/port", "8000"),
            ("model.aibrix.ai/engine", "vllm"),
            ("model.aibrix.ai/kv-connector-type", "nixl"),
        ],
    )
}

fn names(out: &[EndpointPod]) -> Vec<&str> {
    out.iter().map(|p| p.name.as_str()).collect()
}

fn keys() -> LabelKeys {
    LabelKeys::default()
}

#[test]
fn aibrix_pod_maps_to_canonical_endpoint() {
    let mut p = prefill("p0", "10.0.0.5");
    p.metadata.annotations = Some(BTreeMap::from([
        (
            "model.aibrix.ai/sglang-bootstrap-port".to_owned(),
            " 9001 ".to_owned(),
        ),
        ("unrelated/annotation".to_owned(), "x".to_owned()),
    ]));
    let e = classify_pod(&p, &keys()).expect("routable");
    assert_eq!(e.name, "p0");
    assert_eq!(e.namespace, "llm");
    assert_eq!(e.ip.as_deref(), Some("10.0.0.5"));
    assert!(e.ready);
    assert_eq!(e.http_port, 8000);
    assert_eq!(
        e.labels.get("role-name").map(String::as_str),
        Some("prefill")
    );
    assert_eq!(
        e.labels.get(ROLESET_LABEL).map(String::as_str),
        Some("rs-a")
    );
    assert_eq!(e.labels.get(MODEL_LABEL).map(String::as_str), Some("llama"));
    assert_eq!(e.labels.get(ENGINE_LABEL).map(String::as_str), Some("vllm"));
    assert_eq!(
        e.labels.get(CONNECTOR_LABEL).map(String::as_str),
        Some("nixl")
    );
    assert_eq!(
        e.annotations,
        BTreeMap::from([(
            SGLANG_BOOTSTRAP_PORT_ANNOTATION.to_owned(),
            "9001".to_owned()
        )]),
        "only the canonical annotation, trimmed"
    );
}

#[test]
fn port_label_and_default() {
    let p = pod("a", "10.0.0.1", &[(PORT_LABEL, "30080")]);
    assert_eq!(classify_pod(&p, &keys()).map(|e| e.http_port), Ok(30080));
    let p = pod("a", "10.0.0.1", &[]);
    assert_eq!(classify_pod(&p, &keys()).map(|e| e.http_port), Ok(8000));
    let p = pod("a", "10.0.0.1", &[(PORT_LABEL, "")]);
    assert_eq!(classify_pod(&p, &keys()).map(|e| e.http_port), Ok(8000));
    for bad in ["http", "0", "65536", "-1", "80.5"] {
        let p = pod("a", "10.0.0.1", &[(PORT_LABEL, bad)]);
        assert_eq!(
            classify_pod(&p, &keys()),
            Err(SkipReason::BadPort(bad.to_owned())),
            "{bad}"
        );
    }
}

#[test]
fn bad_bootstrap_port_is_not_routable() {
    let mut p = pod("a", "10.0.0.1", &[]);
    p.metadata.annotations = Some(BTreeMap::from([(
        SGLANG_BOOTSTRAP_PORT_ANNOTATION.to_owned(),
        "abc".to_owned(),
    )]));
    assert_eq!(
        classify_pod(&p, &keys()),
        Err(SkipReason::BadBootstrapPort("abc".to_owned()))
    );
}

#[test]
fn the_data_parallel_size_annotation_is_passed_on() {
    let mut p = pod("a", "10.0.0.1", &[]);
    p.metadata.annotations = Some(BTreeMap::from([
        (
            crate::config::DATA_PARALLEL_SIZE_ANNOTATION.to_owned(),
            " 8 ".to_owned(),
        ),
        ("other".to_owned(), "x".to_owned()),
    ]));
    let e = classify_pod(&p, &keys()).expect("routable");
    assert_eq!(
        e.annotations,
        BTreeMap::from([(
            crate::config::DATA_PARALLEL_SIZE_ANNOTATION.to_owned(),
            "8".to_owned()
        )])
    );
    // Empty: as if absent (one rank).
    p.metadata.annotations = Some(BTreeMap::from([(
        crate::config::DATA_PARALLEL_SIZE_ANNOTATION.to_owned(),
        " ".to_owned(),
    )]));
    assert!(
        classify_pod(&p, &keys())
            .expect("routable")
            .annotations
            .is_empty()
    );
}

#[test]
fn readiness_flips() {
    let mut p = prefill("p", "10.0.0.1");
    assert_eq!(names(&routable_pods(&[p.clone()], &keys())), ["p"]);
    set_ready(&mut p, "False");
    assert_eq!(classify_pod(&p, &keys()), Err(SkipReason::NotReady));
    assert!(routable_pods(&[p.clone()], &keys()).is_empty());
    set_ready(&mut p, "Unknown");
    assert_eq!(classify_pod(&p, &keys()), Err(SkipReason::NotReady));
    set_ready(&mut p, "True");
    assert_eq!(names(&routable_pods(&[p.clone()], &keys())), ["p"]);
    // Conditions missing altogether, or no status at all: not ready.
    if let Some(s) = p.status.as_mut() {
        s.conditions = None;
    }
    assert_eq!(classify_pod(&p, &keys()), Err(SkipReason::NotReady));
    p.status = None;
    assert_eq!(classify_pod(&p, &keys()), Err(SkipReason::NotReady));
}

#[test]
fn ip_changes_and_missing_ip() {
    let p1 = prefill("p", "10.0.0.1");
    let p2 = prefill("p", "10.0.0.2");
    let a = routable_pods(&[p1], &keys());
    let b = routable_pods(&[p2], &keys());
    assert_ne!(a, b, "an IP change is a change");
    assert_eq!(b[0].ip.as_deref(), Some("10.0.0.2"));
    for ip in ["", "   "] {
        let p = prefill("p", ip);
        assert_eq!(classify_pod(&p, &keys()), Err(SkipReason::NoIp), "{ip:?}");
    }
    let mut p = prefill("p", "x");
    if let Some(s) = p.status.as_mut() {
        s.pod_ip = None;
    }
    assert_eq!(classify_pod(&p, &keys()), Err(SkipReason::NoIp));
    let p = prefill("p", "fd00::12");
    assert_eq!(
        classify_pod(&p, &keys()).map(|e| e.ip),
        Ok(Some("fd00::12".to_owned()))
    );
}

#[test]
fn relabel_changes_role_and_is_seen() {
    let p = prefill("p", "10.0.0.1");
    let mut d = p.clone();
    if let Some(l) = d.metadata.labels.as_mut() {
        l.insert("role-name".to_owned(), " Decode ".to_owned());
    }
    let before = routable_pods(&[p], &keys());
    let after = routable_pods(&[d], &keys());
    assert_ne!(before, after);
    assert_eq!(
        after[0].labels.get(ROLE_LABEL).map(String::as_str),
        Some("decode"),
        "role trimmed and lower-cased"
    );
}

#[test]
fn role_absent_or_other_is_combined() {
    let p = pod("c", "10.0.0.1", &[("model.aibrix.ai/name", "m")]);
    let e = classify_pod(&p, &keys()).expect("routable");
    assert!(!e.labels.contains_key(ROLE_LABEL));
    let p = pod("c", "10.0.0.1", &[("role-name", "worker")]);
    let e = classify_pod(&p, &keys()).expect("routable");
    assert_eq!(e.labels.get(ROLE_LABEL).map(String::as_str), Some("worker"));
}

#[test]
fn encoder_pods_keep_their_role_under_either_key_scheme() {
    let p = pod("e", "10.0.0.9", &[("role-name", " Encode ")]);
    let e = classify_pod(&p, &keys()).expect("routable");
    assert_eq!(
        e.labels.get(ROLE_LABEL).map(String::as_str),
        Some(ROLE_ENCODE)
    );
    let llm_d = LabelKeys {
        role: "llm-d.ai/role".to_owned(),
        ..LabelKeys::default()
    };
    let p = pod("e", "10.0.0.9", &[("llm-d.ai/role", "encode")]);
    let e = classify_pod(&p, &llm_d).expect("routable");
    assert_eq!(
        e.labels.get(ROLE_LABEL).map(String::as_str),
        Some(ROLE_ENCODE)
    );
    // Not a prefill or decode: roleset pairing keeps it, in a roleset or not.
    let kept = pair_rolesets(vec![
        ep("e1", Some(ROLE_ENCODE), None),
        ep("e2", Some(ROLE_ENCODE), Some("lonely")),
        ep("p", Some("prefill"), Some("lonely")),
    ]);
    assert_eq!(names(&kept), ["e1", "e2"]);
}

#[test]
fn deletions_disappear() {
    let pods = vec![prefill("a", "10.0.0.1"), prefill("b", "10.0.0.2")];
    assert_eq!(names(&routable_pods(&pods, &keys())), ["a", "b"]);
    assert_eq!(names(&routable_pods(&pods[1..], &keys())), ["b"]);
    assert!(routable_pods(&[], &keys()).is_empty());
}

#[test]
fn terminating_and_finished_pods_are_skipped() {
    let mut p = prefill("p", "10.0.0.1");
    p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    assert_eq!(classify_pod(&p, &keys()), Err(SkipReason::Terminating));
    for phase in ["Succeeded", "Failed"] {
        let mut p = prefill("p", "10.0.0.1");
        if let Some(s) = p.status.as_mut() {
            s.phase = Some(phase.to_owned());
        }
        assert_eq!(
            classify_pod(&p, &keys()),
            Err(SkipReason::Finished),
            "{phase}"
        );
    }
}

#[test]
fn multi_node_groups_route_to_leader_only() {
    let leader = pod("g-0", "10.0.0.1", &[(POD_GROUP_INDEX_LABEL, "0")]);
    let worker = pod("g-1", "10.0.0.2", &[(POD_GROUP_INDEX_LABEL, "1")]);
    let odd = pod("g-x", "10.0.0.3", &[(POD_GROUP_INDEX_LABEL, "00")]);
    let solo = pod("solo", "10.0.0.4", &[]);
    assert_eq!(
        classify_pod(&worker, &keys()),
        Err(SkipReason::GroupMember("1".to_owned()))
    );
    assert_eq!(
        classify_pod(&odd, &keys()),
        Err(SkipReason::GroupMember("00".to_owned()))
    );
    assert_eq!(
        names(&routable_pods(&[worker, leader, odd, solo], &keys())),
        ["g-0", "solo"]
    );
}

#[test]
fn no_name_is_skipped() {
    let mut p = prefill("p", "10.0.0.1");
    p.metadata.name = None;
    assert_eq!(classify_pod(&p, &keys()), Err(SkipReason::NoName));
}

#[test]
fn llm_d_key_overrides_map_to_canonical_keys() {
    let keys = LabelKeys {
        role: "llm-d.ai/role".to_owned(),
        model: "llm-d.ai/model".to_owned(),
        port: "llm-d.ai/port".to_owned(),
        connector: "llm-d.ai/connector".to_owned(),
        sglang_bootstrap_port_annotation: "llm-d.ai/bootstrap-port".to_owned(),
        ..LabelKeys::default()
    };
    let mut p = pod(
        "d0",
        "10.0.0.9",
        &[
            ("llm-d.ai/role", "decode"),
            ("llm-d.ai/model", "qwen"),
            ("llm-d.ai/port", "8200"),
            ("llm-d.ai/connector", "nixl"),
            // A stale AIBrix label must not win over the configured key.
            ("role-name", "prefill"),
            ("model.aibrix.ai/name", "stale"),
        ],
    );
    p.metadata.annotations = Some(BTreeMap::from([
        ("llm-d.ai/bootstrap-port".to_owned(), "8999".to_owned()),
        (SGLANG_BOOTSTRAP_PORT_ANNOTATION.to_owned(), "1".to_owned()),
    ]));
    let e = classify_pod(&p, &keys).expect("routable");
    assert_eq!(e.http_port, 8200);
    assert_eq!(e.labels.get(ROLE_LABEL).map(String::as_str), Some("decode"));
    assert_eq!(e.labels.get(MODEL_LABEL).map(String::as_str), Some("qwen"));
    assert_eq!(
        e.labels.get(CONNECTOR_LABEL).map(String::as_str),
        Some("nixl")
    );
    assert_eq!(
        e.labels.get("llm-d.ai/role").map(String::as_str),
        Some("decode"),
        "source labels are kept"
    );
    assert_eq!(
        e.annotations
            .get(SGLANG_BOOTSTRAP_PORT_ANNOTATION)
            .map(String::as_str),
        Some("8999")
    );

    // Under the override the AIBrix label alone no longer counts.
    let only_aibrix = pod("x", "10.0.0.1", &[("role-name", "prefill")]);
    let e = classify_pod(&only_aibrix, &keys).expect("routable");
    assert!(!e.labels.contains_key(ROLE_LABEL));
}

#[test]
fn group_index_key_override() {
    let keys = LabelKeys {
        pod_group_index: "leaderworkerset.sigs.k8s.io/worker-index".to_owned(),
        ..LabelKeys::default()
    };
    let worker = pod(
        "w",
        "10.0.0.2",
        &[("leaderworkerset.sigs.k8s.io/worker-index", "2")],
    );
    assert!(classify_pod(&worker, &keys).is_err());
    // The AIBrix key is ignored once overridden.
    let other = pod("o", "10.0.0.3", &[(POD_GROUP_INDEX_LABEL, "3")]);
    assert!(classify_pod(&other, &keys).is_ok());
}

#[test]
fn output_sorted_by_namespace_then_name_and_deduplicated() {
    let mut a = prefill("a", "10.0.0.1");
    a.metadata.namespace = Some("zz".to_owned());
    let b = prefill("b", "10.0.0.2");
    let c = prefill("a", "10.0.0.3");
    let out = routable_pods(&[a, b.clone(), c, b], &keys());
    let ids: Vec<(&str, &str)> = out
        .iter()
        .map(|p| (p.namespace.as_str(), p.name.as_str()))
        .collect();
    assert_eq!(ids, [("llm", "a"), ("llm", "b"), ("zz", "a")]);
}

#[test]
fn unrelated_label_change_is_a_change_but_annotation_change_is_not() {
    let p = prefill("p", "10.0.0.1");
    let mut q = p.clone();
    q.metadata.annotations = Some(BTreeMap::from([(
        "kubectl.kubernetes.io/restartedAt".to_owned(),
        "now".to_owned(),
    )]));
    assert_eq!(
        routable_pods(std::slice::from_ref(&p), &keys()),
        routable_pods(&[q], &keys()),
        "non-canonical annotations do not churn the snapshot"
    );
    let mut r = p.clone();
    if let Some(l) = r.metadata.labels.as_mut() {
        l.insert("team".to_owned(), "x".to_owned());
    }
    assert_ne!(routable_pods(&[p], &keys()), routable_pods(&[r], &keys()));
}

fn ep(name: &str, role: Option<&str>, roleset: Option<&str>) -> EndpointPod {
    let mut labels = BTreeMap::new();
    if let Some(r) = role {
        labels.insert(ROLE_LABEL.to_owned(), r.to_owned());
    }
    if let Some(r) = roleset {
        labels.insert(ROLESET_LABEL.to_owned(), r.to_owned());
    }
    EndpointPod {
        name: name.to_owned(),
        namespace: "llm".to_owned(),
        ip: Some("10.0.0.1".to_owned()),
        labels,
        ready: true,
        http_port: 8000,
        ..EndpointPod::default()
    }
}

#[test]
fn roleset_pairing_keeps_complete_rolesets_only() {
    let pods = vec![
        ep("a-p", Some("prefill"), Some("a")),
        ep("a-d", Some("decode"), Some("a")),
        ep("b-p", Some("prefill"), Some("b")), // no decode in b
        ep("c-d", Some("decode"), Some("c")),  // no prefill in c
        ep("x-p", Some("prefill"), None),      // no roleset
        ep("combined", None, None),
        ep("other", Some("worker"), Some("b")),
    ];
    assert_eq!(
        names(&pair_rolesets(pods)),
        ["a-p", "a-d", "combined", "other"]
    );
}

#[test]
fn roleset_pairing_is_per_namespace() {
    let p = ep("p", Some("prefill"), Some("a"));
    let mut d = ep("d", Some("decode"), Some("a"));
    d.namespace = "other".to_owned();
    assert!(pair_rolesets(vec![p, d]).is_empty());
}

#[test]
fn roleset_pairing_follows_readiness() {
    // The decode of roleset "a" goes unready: the prefill loses its partner too.
    let p = prefill("p", "10.0.0.1");
    let mut d = prefill("d", "10.0.0.2");
    if let Some(l) = d.metadata.labels.as_mut() {
        l.insert("role-name".to_owned(), "decode".to_owned());
    }
    let both = pair_rolesets(routable_pods(&[p.clone(), d.clone()], &keys()));
    assert_eq!(names(&both), ["d", "p"]);
    set_ready(&mut d, "False");
    assert!(pair_rolesets(routable_pods(&[p, d], &keys())).is_empty());
}

#[test]
fn skip_summary_counts_reasons() {
    let mut unready = prefill("u", "10.0.0.1");
    set_ready(&mut unready, "False");
    let noip = prefill("n", "");
    let ok = prefill("ok", "10.0.0.2");
    let s = skip_summary(&[unready, noip, ok], &keys());
    assert_eq!(s, BTreeMap::from([("no_ip", 1), ("not_ready", 1)]));
}
