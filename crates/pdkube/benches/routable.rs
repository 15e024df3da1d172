//! How long the pure mapping takes for a whole store (it runs once per debounce window).

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use k8s_openapi::api::core::v1::{Pod, PodCondition, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use pdkube::{LabelKeys, pair_rolesets, routable_pods};

fn pods(n: usize) -> Vec<Pod> {
    (0..n)
        .map(|i| {
            let role = if i % 3 == 0 { "decode" } else { "prefill" };
            let labels = BTreeMap::from([
                ("role-name".to_owned(), role.to_owned()),
                ("roleset-name".to_owned(), format!("rs-{}", i / 6)),
                ("model.aibrix.ai/name".to_owned(), "llama".to_owned()),
                ("model.aibrix.ai/port".to_owned(), "8000".to_owned()),
                (
                    "model.aibrix.ai/kv-connector-type".to_owned(),
                    "nixl".to_owned(),
                ),
                ("pod-template-hash".to_owned(), "5d9f8c7b6".to_owned()),
            ]);
            Pod {
                metadata: ObjectMeta {
                    name: Some(format!("engine-{i}")),
                    namespace: Some("llm".to_owned()),
                    labels: Some(labels),
                    ..ObjectMeta::default()
                },
                spec: None,
                status: Some(PodStatus {
                    pod_ip: Some(format!("10.0.{}.{}", i / 250, i % 250)),
                    conditions: Some(vec![PodCondition {
                        type_: "Ready".to_owned(),
                        status: if i % 10 == 9 { "False" } else { "True" }.to_owned(),
                        ..PodCondition::default()
                    }]),
                    ..PodStatus::default()
                }),
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let keys = LabelKeys::default();
    let mut group = c.benchmark_group("routable_pods");
    for n in [100, 1_000, 10_000] {
        let input = pods(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &input, |b, input| {
            b.iter(|| routable_pods(black_box(input), &keys))
        });
        group.bench_with_input(BenchmarkId::new("with_pairing", n), &input, |b, input| {
            b.iter(|| pair_rolesets(routable_pods(black_box(input), &keys)))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
