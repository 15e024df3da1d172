//! Tests of the request record.

use super::*;

#[test]
fn a_record_counts_once_and_drop_means_cancelled() {
    let m = Arc::new(Metrics::new());
    let mut r = RequestRecord::start(m.clone(), "completions");
    r.set_connector("shfs");
    r.finish_ok();
    drop(r);
    drop(RequestRecord::start(m.clone(), "chat"));
    let text = m.render();
    assert!(
        text.contains(
            r#"pdgate_requests_total{route="completions",connector="shfs",outcome="success",model=""} 1"#
        ),
        "{text}"
    );
    assert!(
        text.contains(
            r#"pdgate_requests_total{route="chat",connector="",outcome="cancelled",model=""} 1"#
        ),
        "{text}"
    );
}
