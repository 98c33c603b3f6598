//! Binding a call's positional and keyword arguments to the fields of a
//! struct argument, as Python binds a call of `def f(a, b=None)`: the
//! rule Python callers of a Rust function with a struct argument get
//! (keywords name its fields), kept apart from Python's objects.

/// Where a field's value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The positional argument at this index.
    Positional(usize),
    /// The keyword argument at this index (in the order given).
    Keyword(usize),
    /// Neither: an optional field, `None`.
    Absent,
}

/// A field of a struct argument as binding sees it.
#[derive(Debug, Clone, Copy)]
pub struct Param<'a> {
    /// Its name.
    pub name: &'a str,
    /// Whether it may be left out (an `Option` field: `None`).
    pub optional: bool,
}

/// Binds `positional` positional arguments and the keywords `keywords`
/// (their names; `None` for a key that is not a `str`) to `params`: the
/// positional ones in order, then each keyword to the field of its name.
/// The source of each field, in `params`' order; or why the call does
/// not fit, in Python's words: too many positional arguments, a keyword
/// that is not a `str`, names no field or repeats one already given, or
/// a required field missing.
pub fn bind(
    params: &[Param<'_>],
    positional: usize,
    keywords: &[Option<&str>],
) -> Result<Vec<Source>, String> {
    let names = || params.iter().map(|p| p.name).collect::<Vec<_>>().join(", ");
    if positional > params.len() {
        return Err(format!(
            "takes {} arguments ({}), {positional} given",
            params.len(),
            names()
        ));
    }
    let mut sources: Vec<Option<Source>> = (0..params.len())
        .map(|i| (i < positional).then_some(Source::Positional(i)))
        .collect();
    for (k, keyword) in keywords.iter().enumerate() {
        let Some(name) = keyword else {
            return Err("got a keyword that is not a str".into());
        };
        let Some(at) = params.iter().position(|p| p.name == *name) else {
            return Err(format!(
                "got an unexpected keyword argument {name:?} (its arguments: {})",
                names()
            ));
        };
        if sources[at].is_some() {
            return Err(format!("got multiple values for argument {name:?}"));
        }
        sources[at] = Some(Source::Keyword(k));
    }
    let missing: Vec<String> = params
        .iter()
        .zip(&sources)
        .filter(|(p, s)| s.is_none() && !p.optional)
        .map(|(p, _)| format!("{:?}", p.name))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "missing {} required argument{}: {}",
            missing.len(),
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", ")
        ));
    }
    Ok(sources
        .into_iter()
        .map(|s| s.unwrap_or(Source::Absent))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params<'a>(spec: &[(&'a str, bool)]) -> Vec<Param<'a>> {
        spec.iter()
            .map(|&(name, optional)| Param { name, optional })
            .collect()
    }

    #[test]
    fn binds_as_python_binds_a_call() {
        let p = params(&[("x", false), ("y", false), ("alpha", true)]);
        use Source::*;
        assert_eq!(
            bind(&p, 2, &[]),
            Ok(vec![Positional(0), Positional(1), Absent])
        );
        assert_eq!(
            bind(&p, 1, &[Some("alpha"), Some("y")]),
            Ok(vec![Positional(0), Keyword(1), Keyword(0)])
        );
        assert_eq!(
            bind(&p, 0, &[Some("y"), Some("x")]),
            Ok(vec![Keyword(1), Keyword(0), Absent])
        );
        for (positional, keywords, error) in [
            (4, vec![], "takes 3 arguments (x, y, alpha), 4 given"),
            (
                2,
                vec![Some("beta")],
                "unexpected keyword argument \"beta\"",
            ),
            (
                1,
                vec![Some("x"), Some("y")],
                "multiple values for argument \"x\"",
            ),
            (1, vec![], "missing 1 required argument: \"y\""),
            (
                0,
                vec![Some("alpha")],
                "missing 2 required arguments: \"x\", \"y\"",
            ),
            (2, vec![None], "a keyword that is not a str"),
        ] {
            let e = bind(&p, positional, &keywords).unwrap_err();
            assert!(e.contains(error), "{positional} {keywords:?}: {e}");
        }
        assert_eq!(bind(&[], 0, &[]), Ok(vec![]));
    }

    const NAMES: [&str; 6] = ["a", "b", "c", "d", "e", "zz"];

    proptest! {
        /// Any call binds, or is refused, exactly as Python's rule says:
        /// bound, every field has one source (positional ones in order,
        /// keywords by name, absent only if optional) and every argument
        /// is used once; refused, the call breaks the rule.
        #[test]
        fn a_binding_follows_pythons_rule(
            fields in prop::collection::vec(any::<bool>(), 0..5),
            positional in 0usize..7,
            keywords in prop::collection::vec(prop::option::weighted(0.95, 0usize..6), 0..6),
        ) {
            let params: Vec<Param<'_>> = fields
                .iter()
                .enumerate()
                .map(|(i, &optional)| Param { name: NAMES[i], optional })
                .collect();
            let keywords: Vec<Option<&str>> =
                keywords.iter().map(|k| k.map(|i| NAMES[i])).collect();
            let valid = positional <= params.len()
                && keywords.iter().enumerate().all(|(k, name)| {
                    name.is_some_and(|name| {
                        params.iter().position(|p| p.name == name).is_some_and(|at| {
                            at >= positional && !keywords[..k].contains(&Some(name))
                        })
                    })
                })
                && params.iter().enumerate().all(|(i, p)| {
                    p.optional || i < positional || keywords.contains(&Some(p.name))
                });
            match bind(&params, positional, &keywords) {
                Ok(sources) => {
                    prop_assert!(valid);
                    prop_assert_eq!(sources.len(), params.len());
                    let mut used = vec![false; keywords.len()];
                    for (i, (p, s)) in params.iter().zip(&sources).enumerate() {
                        match *s {
                            Source::Positional(j) => prop_assert_eq!(i, j),
                            Source::Keyword(k) => {
                                prop_assert_eq!(keywords[k], Some(p.name));
                                prop_assert!(!used[k]);
                                used[k] = true;
                            }
                            Source::Absent => prop_assert!(p.optional && i >= positional),
                        }
                    }
                    prop_assert!(used.iter().all(|u| *u));
                }
                Err(_) => prop_assert!(!valid),
            }
        }
    }
}
