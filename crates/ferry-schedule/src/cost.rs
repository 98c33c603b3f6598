//! The cost model of the duration-aware simulator ([`crate::simulate_timed`]):
//! how long each action takes and how long a transfer between two stages
//! takes.
//!
//! Times are plain numbers in whatever unit the user picks (milliseconds,
//! or "one forward" as the closed-form tests do). A [`Costs`] holds:
//!
//! - F, B, I and W costs for every stage ([`StageCosts`]), with per-stage
//!   overrides;
//! - a [`Link`] (latency and bandwidth) for every stage boundary (the
//!   boundary `s` joins stage `s` and stage `s + 1`), with per-boundary
//!   overrides; a transfer takes `latency + activation_bytes / bandwidth`
//!   (the gradient sent back has the activation's size);
//! - the costs of UNSHARD, RESHARD and REDUCE_GRAD (0 by default).
//!
//! The text form, as the `ferry-schedule compare --costs` option takes it,
//! is a comma-separated list of `KEY=VALUE` items; `KEY@N=VALUE` overrides
//! stage `N` (for F, B, I, W) or boundary `N` (for `latency`, `bandwidth`):
//!
//! ```
//! use ferry_schedule::Costs;
//!
//! let costs: Costs = "F=1,B=2,I=1,W=1,latency=0.1,F@3=1.5".parse()?;
//! assert_eq!(costs.stage(0).forward, 1.0);
//! assert_eq!(costs.stage(3).forward, 1.5);
//! assert_eq!(costs.transfer(0), 0.1);
//!
//! let err = "F=x".parse::<Costs>().unwrap_err();
//! assert_eq!(err.to_string(), "cost F=x: not a number");
//! # Ok::<(), ferry_schedule::CostError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// The compute costs of one stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageCosts {
    /// `F`: forward of one microbatch.
    pub forward: f64,
    /// `B`: full backward (inputs and weights) of one microbatch.
    pub backward: f64,
    /// `I`: backward for the stage's inputs.
    pub backward_input: f64,
    /// `W`: backward for the stage's weights.
    pub backward_weight: f64,
}

impl StageCosts {
    /// Every compute cost multiplied by `factor`.
    pub fn scaled(self, factor: f64) -> StageCosts {
        StageCosts {
            forward: self.forward * factor,
            backward: self.backward * factor,
            backward_input: self.backward_input * factor,
            backward_weight: self.backward_weight * factor,
        }
    }
}

/// A stage boundary's link: a transfer of `bytes` takes
/// `latency + bytes / bandwidth`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Time from a send to its data being usable, for zero bytes.
    pub latency: f64,
    /// Bytes per time unit (`f64::INFINITY`: size costs nothing).
    pub bandwidth: f64,
}

/// Every cost the duration-aware simulator needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Costs {
    /// Compute costs of every stage without an override.
    pub stage: StageCosts,
    /// Compute costs of particular stages, by stage.
    pub stage_overrides: BTreeMap<usize, StageCosts>,
    /// The link of every boundary without an override.
    pub link: Link,
    /// Links of particular boundaries (boundary `s`: stage `s` to `s + 1`).
    pub link_overrides: BTreeMap<usize, Link>,
    /// Bytes of one microbatch's activation (and of its gradient).
    pub activation_bytes: f64,
    /// Cost of an UNSHARD.
    pub unshard: f64,
    /// Cost of a RESHARD.
    pub reshard: f64,
    /// Cost of a REDUCE_GRAD.
    pub reduce_grad: f64,
}

impl Default for Costs {
    /// F = 1, B = 2, I = 1, W = 1 on every stage; free links; UNSHARD,
    /// RESHARD and REDUCE_GRAD free.
    fn default() -> Costs {
        Costs::uniform(1.0, 2.0, 1.0, 1.0)
    }
}

impl Costs {
    /// The same F, B, I, W costs on every stage; free links; UNSHARD,
    /// RESHARD and REDUCE_GRAD free.
    pub fn uniform(forward: f64, backward: f64, input: f64, weight: f64) -> Costs {
        Costs {
            stage: StageCosts {
                forward,
                backward,
                backward_input: input,
                backward_weight: weight,
            },
            stage_overrides: BTreeMap::new(),
            link: Link {
                latency: 0.0,
                bandwidth: f64::INFINITY,
            },
            link_overrides: BTreeMap::new(),
            activation_bytes: 0.0,
            unshard: 0.0,
            reshard: 0.0,
            reduce_grad: 0.0,
        }
    }

    /// These costs with every link's latency set to `latency`.
    pub fn with_latency(mut self, latency: f64) -> Costs {
        self.link.latency = latency;
        for link in self.link_overrides.values_mut() {
            link.latency = latency;
        }
        self
    }

    /// The compute costs of `stage`.
    pub fn stage(&self, stage: usize) -> StageCosts {
        self.stage_overrides
            .get(&stage)
            .copied()
            .unwrap_or(self.stage)
    }

    /// The link of boundary `boundary` (stage `boundary` to `boundary + 1`).
    pub fn link(&self, boundary: usize) -> Link {
        self.link_overrides
            .get(&boundary)
            .copied()
            .unwrap_or(self.link)
    }

    /// How long one microbatch's activation (or gradient) takes across
    /// boundary `boundary`: latency plus bytes over bandwidth.
    pub fn transfer(&self, boundary: usize) -> f64 {
        let link = self.link(boundary);
        if self.activation_bytes == 0.0 {
            link.latency
        } else {
            link.latency + self.activation_bytes / link.bandwidth
        }
    }

    /// These costs with every compute cost (F, B, I, W of every stage)
    /// multiplied by `factor`; links and per-stage actions unchanged. The
    /// planner uses it to split a rank's share of the model into several
    /// stages.
    pub fn compute_scaled(&self, factor: f64) -> Costs {
        let mut out = self.clone();
        out.stage = self.stage.scaled(factor);
        for costs in out.stage_overrides.values_mut() {
            *costs = costs.scaled(factor);
        }
        out
    }

    /// Checks every cost is a finite number ≥ 0 and every bandwidth > 0.
    pub fn check(&self) -> Result<(), CostError> {
        let stages = std::iter::once((None, &self.stage))
            .chain(self.stage_overrides.iter().map(|(s, c)| (Some(*s), c)));
        for (at, c) in stages {
            for (key, value) in [
                ("F", c.forward),
                ("B", c.backward),
                ("I", c.backward_input),
                ("W", c.backward_weight),
            ] {
                check_value(&item(key, at, value), value)?;
            }
        }
        let links = std::iter::once((None, &self.link))
            .chain(self.link_overrides.iter().map(|(s, l)| (Some(*s), l)));
        for (at, link) in links {
            check_value(&item("latency", at, link.latency), link.latency)?;
            let text = item("bandwidth", at, link.bandwidth);
            if link.bandwidth.is_nan() || link.bandwidth <= 0.0 {
                return Err(CostError::NotPositive { item: text });
            }
        }
        for (key, value) in [
            ("bytes", self.activation_bytes),
            ("UNSHARD", self.unshard),
            ("RESHARD", self.reshard),
            ("REDUCE_GRAD", self.reduce_grad),
        ] {
            check_value(&item(key, None, value), value)?;
        }
        Ok(())
    }
}

fn item(key: &str, at: Option<usize>, value: f64) -> String {
    match at {
        Some(at) => format!("{key}@{at}={value}"),
        None => format!("{key}={value}"),
    }
}

fn check_value(item: &str, value: f64) -> Result<(), CostError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(CostError::Negative {
            item: item.to_owned(),
        })
    }
}

/// Costs text (or values) that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CostError {
    /// An item has no `=`.
    #[error("cost {item}: expected KEY=VALUE, e.g. F=1")]
    MissingEquals {
        /// The item as written.
        item: String,
    },
    /// The value is not a number.
    #[error("cost {item}: not a number")]
    NotANumber {
        /// The item as written.
        item: String,
    },
    /// The key is not a cost.
    #[error("cost {item}: unknown key {key:?}; expected F, B, I, W, UNSHARD, RESHARD, REDUCE_GRAD, latency, bandwidth or bytes")]
    UnknownKey {
        /// The item as written.
        item: String,
        /// The key.
        key: String,
    },
    /// `KEY@N` where N is not a stage (or boundary) number, or where the
    /// key takes no `@N`.
    #[error("cost {item}: {reason}")]
    BadOverride {
        /// The item as written.
        item: String,
        /// What is wrong with the `@N`.
        reason: String,
    },
    /// The same key (and `@N`) is given twice.
    #[error("cost {item}: {key} is given twice")]
    Twice {
        /// The second item as written.
        item: String,
        /// The key (with its `@N`).
        key: String,
    },
    /// A cost is negative, infinite or NaN.
    #[error("cost {item}: must be a finite number >= 0")]
    Negative {
        /// The item.
        item: String,
    },
    /// A bandwidth is zero, negative or NaN.
    #[error("cost {item}: bandwidth must be > 0")]
    NotPositive {
        /// The item.
        item: String,
    },
}

/// Parses the text form: `F=1,B=2,I=1,W=1`, with optional `UNSHARD=`,
/// `RESHARD=`, `REDUCE_GRAD=`, `latency=`, `bandwidth=` (bytes per time
/// unit), `bytes=` (one microbatch's activation), and `KEY@N=` overrides
/// of stage `N` (F, B, I, W) or boundary `N` (latency, bandwidth).
/// Unnamed keys keep [`Costs::default`]'s values, except that B defaults
/// to I + W when I or W is given and B is not. Spaces around items are
/// ignored; an empty text is the defaults.
impl FromStr for Costs {
    type Err = CostError;

    fn from_str(text: &str) -> Result<Costs, CostError> {
        let mut items: Vec<Item> = Vec::new();
        for raw in text.split(',') {
            let item = raw.trim();
            if item.is_empty() {
                continue;
            }
            let parsed = Item::parse(item)?;
            if items
                .iter()
                .any(|i| i.key == parsed.key && i.at == parsed.at)
            {
                let key = match parsed.at {
                    Some(n) => format!("{}@{n}", parsed.key),
                    None => parsed.key.to_owned(),
                };
                return Err(CostError::Twice {
                    item: item.to_owned(),
                    key,
                });
            }
            items.push(parsed);
        }
        let mut costs = Costs::default();
        // Defaults first; overrides start from the defaults, whatever the
        // order of the items.
        apply_stage_items(&mut costs.stage, items.iter().filter(|i| i.at.is_none()));
        for item in items.iter().filter(|i| i.at.is_none()) {
            match item.key {
                "latency" => costs.link.latency = item.value,
                "bandwidth" => costs.link.bandwidth = item.value,
                "UNSHARD" => costs.unshard = item.value,
                "RESHARD" => costs.reshard = item.value,
                "REDUCE_GRAD" => costs.reduce_grad = item.value,
                "bytes" => costs.activation_bytes = item.value,
                _ => {}
            }
        }
        for item in items.iter().filter(|i| i.at.is_some()) {
            let n = item.at.unwrap_or_default();
            match item.key {
                "latency" => {
                    let link = costs.link_overrides.entry(n).or_insert(costs.link);
                    link.latency = item.value;
                }
                "bandwidth" => {
                    let link = costs.link_overrides.entry(n).or_insert(costs.link);
                    link.bandwidth = item.value;
                }
                _ => {
                    if !costs.stage_overrides.contains_key(&n) {
                        let mut c = costs.stage;
                        apply_stage_items(&mut c, items.iter().filter(|i| i.at == Some(n)));
                        costs.stage_overrides.insert(n, c);
                    }
                }
            }
        }
        costs.check()?;
        Ok(costs)
    }
}

/// One `KEY[@N]=VALUE` item, checked.
struct Item {
    key: &'static str,
    at: Option<usize>,
    value: f64,
}

const KEYS: [&str; 10] = [
    "F",
    "B",
    "I",
    "W",
    "UNSHARD",
    "RESHARD",
    "REDUCE_GRAD",
    "latency",
    "bandwidth",
    "bytes",
];

impl Item {
    fn parse(item: &str) -> Result<Item, CostError> {
        let Some((key_text, value_text)) = item.split_once('=') else {
            return Err(CostError::MissingEquals {
                item: item.to_owned(),
            });
        };
        let (key_text, at_text) = match key_text.split_once('@') {
            Some((key, at)) => (key.trim(), Some(at.trim())),
            None => (key_text.trim(), None),
        };
        let Some(key) = KEYS.into_iter().find(|k| *k == key_text) else {
            return Err(CostError::UnknownKey {
                item: item.to_owned(),
                key: key_text.to_owned(),
            });
        };
        let at = match at_text {
            None => None,
            Some(_) if !["F", "B", "I", "W", "latency", "bandwidth"].contains(&key) => {
                return Err(CostError::BadOverride {
                    item: item.to_owned(),
                    reason: format!("{key} takes no @N override"),
                })
            }
            Some(at) => Some(at.parse::<usize>().map_err(|_| CostError::BadOverride {
                item: item.to_owned(),
                reason: format!("{at:?} after @ is not a stage or boundary number"),
            })?),
        };
        let value = value_text
            .trim()
            .parse::<f64>()
            .map_err(|_| CostError::NotANumber {
                item: item.to_owned(),
            })?;
        if key == "bandwidth" {
            if value.is_nan() || value <= 0.0 {
                return Err(CostError::NotPositive {
                    item: item.to_owned(),
                });
            }
        } else {
            check_value(item, value)?;
        }
        Ok(Item { key, at, value })
    }
}

fn apply_stage_items<'a>(costs: &mut StageCosts, items: impl Iterator<Item = &'a Item>) {
    let mut b_given = false;
    let mut split_given = false;
    for item in items {
        match item.key {
            "F" => costs.forward = item.value,
            "B" => {
                costs.backward = item.value;
                b_given = true;
            }
            "I" => {
                costs.backward_input = item.value;
                split_given = true;
            }
            "W" => {
                costs.backward_weight = item.value;
                split_given = true;
            }
            _ => {}
        }
    }
    if split_given && !b_given {
        costs.backward = costs.backward_input + costs.backward_weight;
    }
}

impl fmt::Display for Costs {
    /// The text form, which parses back to equal costs: the default stage
    /// costs and latency always, then whatever differs from a free link
    /// and free per-stage actions, then every override, e.g.
    /// `F=1,B=2,I=1,W=1,latency=0,F@3=1.5,B@3=2,I@3=1,W@3=1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.stage;
        write!(
            f,
            "F={},B={},I={},W={},latency={}",
            s.forward, s.backward, s.backward_input, s.backward_weight, self.link.latency
        )?;
        if self.link.bandwidth != f64::INFINITY {
            write!(f, ",bandwidth={}", self.link.bandwidth)?;
        }
        for (key, value) in [
            ("bytes", self.activation_bytes),
            ("UNSHARD", self.unshard),
            ("RESHARD", self.reshard),
            ("REDUCE_GRAD", self.reduce_grad),
        ] {
            if value != 0.0 {
                write!(f, ",{key}={value}")?;
            }
        }
        for (n, c) in &self.stage_overrides {
            write!(
                f,
                ",F@{n}={},B@{n}={},I@{n}={},W@{n}={}",
                c.forward, c.backward, c.backward_input, c.backward_weight
            )?;
        }
        for (n, link) in &self.link_overrides {
            write!(
                f,
                ",latency@{n}={},bandwidth@{n}={}",
                link.latency, link.bandwidth
            )?;
        }
        Ok(())
    }
}
