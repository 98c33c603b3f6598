//! The SVG timeline: well-formed, one group per rank, every action drawn.

use ferry_schedule::{add_send_recv, simulate_unit_steps, svg, Schedule, ScheduleKind};

/// A small XML well-formedness check: every tag closes in order, every
/// attribute value is quoted, and no text holds a bare `<` or `&`.
fn check_well_formed(doc: &str) -> Result<(), String> {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = doc;
    while let Some(open) = rest.find('<') {
        let text = &rest[..open];
        if let Some(amp) = text.find('&') {
            let entity = &text[amp..];
            if !["&amp;", "&lt;", "&gt;", "&quot;"]
                .iter()
                .any(|e| entity.starts_with(e))
            {
                return Err(format!("bare & in {text:?}"));
            }
        }
        let close = rest[open..].find('>').ok_or("unclosed tag")? + open;
        let tag = &rest[open + 1..close];
        if tag.contains('<') {
            return Err(format!("< inside tag {tag:?}"));
        }
        if let Some(name) = tag.strip_prefix('/') {
            let top = stack.pop().ok_or(format!("</{name}> closes nothing"))?;
            if top != name {
                return Err(format!("</{name}> closes <{top}>"));
            }
        } else {
            if tag.matches('"').count() % 2 != 0 {
                return Err(format!("unbalanced quotes in {tag:?}"));
            }
            let name = tag
                .split_whitespace()
                .next()
                .ok_or("empty tag")?
                .trim_end_matches('/')
                .to_string();
            if !tag.ends_with('/') {
                stack.push(name);
            }
        }
        rest = &rest[close + 1..];
    }
    if stack.is_empty() {
        Ok(())
    } else {
        Err(format!("unclosed {stack:?}"))
    }
}

#[test]
fn well_formed_check_rejects_broken_documents() {
    assert!(check_well_formed("<svg><g></g></svg>").is_ok());
    assert!(check_well_formed("<svg><g></svg>").is_err());
    assert!(check_well_formed("<svg><text>a & b</text></svg>").is_err());
    assert!(check_well_formed("<svg><rect x=\"1/></svg>").is_err());
}

#[test]
fn svg_has_one_group_per_rank_and_every_action() {
    for (kind, ranks, per_rank, micro) in [
        (ScheduleKind::ZbvZeroBubble, 4, 2, 8),
        (ScheduleKind::OneFOneB, 4, 1, 8),
        (ScheduleKind::DualPipeV, 2, 2, 4),
        (ScheduleKind::InterleavedZeroBubble, 2, 2, 4),
    ] {
        let placement = kind
            .placement()
            .stage_to_rank(ranks * per_rank, ranks)
            .expect("placement");
        let compute = kind.generate(ranks, per_rank, micro).expect("generates");
        let lowered = add_send_recv(&compute, &placement).expect("lowers");
        let timeline = simulate_unit_steps(&lowered, &placement)
            .expect("finishes")
            .to_schedule();
        let doc = svg(&timeline);
        check_well_formed(&doc).unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert!(doc.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert_eq!(doc.matches("<g class=\"rank\"").count(), ranks, "{kind}");
        for rank in 0..ranks {
            let start = doc
                .find(&format!("<g class=\"rank\" id=\"rank-{rank}\">"))
                .expect("rank group");
            let end = start + doc[start..].find("\n</g>").expect("group closes");
            let group = &doc[start..end];
            let actions: Vec<_> = timeline.ranks[rank].iter().flatten().collect();
            assert_eq!(
                group.matches("<g class=\"action\">").count(),
                actions.len(),
                "{kind} rank {rank}"
            );
            for action in actions {
                assert!(
                    group.contains(&format!("<title>{action}</title>")),
                    "{kind} rank {rank}: {action} missing"
                );
            }
            let bubbles = timeline.ranks[rank].iter().filter(|s| s.is_none()).count();
            assert!(group.matches("class=\"bubble\"").count() >= bubbles);
        }
    }
}

#[test]
fn bubbles_and_microbatch_numbers_are_drawn() {
    let timeline = Schedule::from_csv("0F0,,0B0\r\n,1F7,\r\n").expect("parses");
    let doc = svg(&timeline);
    check_well_formed(&doc).expect("well formed");
    // Rank 0 idles once; rank 1 idles at step 0 and after its last action.
    assert_eq!(doc.matches("class=\"bubble\"").count(), 3);
    assert!(doc.contains(">7</text>"));
    assert!(doc.contains("<title>1F7</title>"));
}

#[test]
fn overlap_action_text_is_escaped_and_labelled() {
    let timeline = Schedule::from_csv("(0F3;3B1)OVERLAP_F_B\r\n").expect("parses");
    let doc = svg(&timeline);
    check_well_formed(&doc).expect("well formed");
    assert!(doc.contains("<title>(0F3;3B1)OVERLAP_F_B</title>"));
    assert!(doc.contains(">3/1</text>"));
}
