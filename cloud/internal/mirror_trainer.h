// The model half of PerDeviceStrategy (cloud/trainer.h): what a job trains and how. The
// strategy owns the per-device bookkeeping (state files, cursor, encoder, replay buffer,
// publishing); a MirrorTrainer owns the frozen models and trains one device's mirror.
//
// A teacher-student pair of model folders (teacher_dir, student_base_dir; a cdcca family is
// the pair DIR/teacher, DIR), the student loaded at the devices' precision with the adapters
// they run, one distill::PairDistiller per device. One student model is shared, and the jobs
// of different devices that wait for it at once run together, up to
// options.max_jobs_together of them (distill::PairDistiller::RunTogether: one forward pass
// over all their rows, each device's result what its job alone gives): the first of them
// to hold the model runs the group for all, as LevelDB's first writer writes a batch for the
// writers queued behind it.
//
// Thread-safety: Train, TeacherAnswers and StudentAnswers may run concurrently for different
// devices, never for one device at once.
#ifndef CDCCA_CLOUD_INTERNAL_MIRROR_TRAINER_H_
#define CDCCA_CLOUD_INTERNAL_MIRROR_TRAINER_H_

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cloud/train_round.h"
#include "cloud/trainer.h"
#include "cloud/uplink_check.h"
#include "compress/named_tensors.h"
#include "compress/uplink_codec.h"
#include "distill/akd.h"
#include "distill/job.h"
#include "distill/pair_distiller.h"
#include "distill/pair_side.h"
#include "distill/replay_buffer.h"
#include "model/arch/answerer.h"
#include "model/arch/multimodal_model.h"

namespace cdcca::cloud::internal {

class MirrorTrainer {
 public:
  // Loads the pair (options.teacher_dir, options.student_base_dir); refuses a pair whose
  // towers differ, since the teacher reads the devices' tower tokens.
  static absl::StatusOr<std::unique_ptr<MirrorTrainer>> Create(
      const PerDeviceStrategyOptions& options);

  // The pretrained student's trainable set (fp32 CPU): every device's version 0.
  const compress::NamedTensors& base_trainable() const;
  // What Register compares: the student base devices must run, and the teacher's tower.
  uint64_t base_fingerprint() const;
  uint64_t vision_fingerprint() const;
  // What an uplinked batch must be for this model.
  const SampleSpec& spec() const;
  // Trains the student with `mirror` as its trainable set on `samples` (and replayed ones
  // from `replay`); `version` is the mirror's (it varies the job's seed). The learner state
  // that persists between a device's jobs (phi, psi) is kept per `device_id`. A sample it
  // cannot use (a frame that does not decode) is left out and listed in TrainedSet::rejected;
  // an error means the job as a whole failed. Calls for other devices that wait at the same
  // time may train together with this one (the result is the same); `replay` is then read by
  // the call that runs the group, while this one waits.
  absl::StatusOr<TrainedSet> Train(const std::string& device_id,
                                   const compress::NamedTensors& mirror,
                                   const std::vector<compress::UplinkSample>& samples,
                                   distill::ReplayBuffer* replay, uint64_t version);
  // Train's arguments for one device, for TrainTogether (not owned; they outlive the call).
  struct DeviceJob {
    std::string device_id;
    const compress::NamedTensors* mirror = nullptr;
    const std::vector<compress::UplinkSample>* samples = nullptr;
    distill::ReplayBuffer* replay = nullptr;
  };
  // Trains several devices' jobs together (distinct devices; InvalidArgument for a device
  // that appears twice): result i is what Train of jobs[i] alone gives. What Train runs for
  // the calls that wait at once.
  std::vector<absl::StatusOr<TrainedSet>> TrainTogether(const std::vector<DeviceJob>& jobs);
  // Whether a sample can be answered and trained on at all (a frame decodes to the tower's
  // input); cheap, no model runs. The held-out pool takes only samples that pass, so that
  // one unusable sample can never fail every guarded job after it.
  absl::Status CheckSample(const compress::UplinkSample& sample) const;
  // Drops what persists between `device_id`'s jobs (after a job that went non-finite, whose
  // learner state may be too, or whose update was withheld); its next job starts it afresh.
  void Forget(const std::string& device_id);

  // The update guard's two sides (cloud/update_guard.h), one answer per sample, each a string
  // that equals another exactly when the two answers are the same answer:
  // the teacher's greedy answer from what it labels a job's sample from (its pseudo-label),
  // and with `entropies` the mean entropy (nats) of its answer tokens per sample (how sure it
  // is: distill::GreedyAnswer's),
  absl::StatusOr<std::vector<std::string>> TeacherAnswers(
      const std::vector<const compress::UplinkSample*>& samples,
      std::vector<double>* entropies = nullptr);
  // and the student's greedy answer on the same input with `mirror` as its trainable set:
  // what the device answers with that state. May run concurrently with Train for another
  // device (it waits where the trainer shares one student).
  absl::StatusOr<std::vector<std::string>> StudentAnswers(
      const compress::NamedTensors& mirror,
      const std::vector<const compress::UplinkSample*>& samples);
  // The teacher's probability of answering each sample with answers[i] (an answer as the two
  // calls above return it), read as TeacherAnswers reads the sample
  // (distill::AnswerProbability): what the guard's kTeacherProbability measure scores. These
  // calls run a training batch's worth of samples per pass (distill::GreedyAnswers,
  // distill::AnswerProbabilities).
  absl::StatusOr<std::vector<double>> TeacherProbabilities(
      const std::vector<const compress::UplinkSample*>& samples,
      const std::vector<std::string>& answers);
  // The pretrained base student's probability of answering each sample with answers[i], read
  // as StudentAnswers reads it (the base trainable set: what a device holds before any
  // update): the second judge of the guard's kTeacherAndBase measure.
  absl::StatusOr<std::vector<double>> BaseProbabilities(
      const std::vector<const compress::UplinkSample*>& samples,
      const std::vector<std::string>& answers);

 private:
  MirrorTrainer() = default;

  // A Train call waiting for the student, or run by another call's group.
  struct TrainRequest {
    DeviceJob job;
    absl::StatusOr<TrainedSet> result = absl::UnknownError("not run");
    bool done = false;  // guarded by queue_mu_
  };

  // Helpers of the methods above, commented where they are defined.
  std::vector<absl::StatusOr<TrainedSet>> TrainGroup(const std::vector<DeviceJob>& jobs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies `state` into the shared student's trainable set; `what` names it in errors.
  // Caller holds mu_.
  absl::Status HoldStudentState(const compress::NamedTensors& state, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `side`'s probability of each answer (TeacherProbabilities, BaseProbabilities); `what`
  // names the side in errors. Caller holds mu_.
  absl::StatusOr<std::vector<double>> Probabilities(
      const distill::PairSide& side, const std::vector<const compress::UplinkSample*>& samples,
      const std::vector<std::string>& answers, const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<distill::PairSample> JobSample(const compress::UplinkSample& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<std::string>> Answers(
      const distill::PairSide& side, const std::vector<const compress::UplinkSample*>& samples,
      std::vector<double>* entropies = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status InBatches(
      const std::vector<const compress::UplinkSample*>& samples,
      const std::function<absl::Status(const std::vector<const distill::PairSample*>&, size_t)>&
          run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::vector<float>> TokensOfFrame(const compress::UplinkSample& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after Create.
  distill::DistillSettings settings_;
  model::AdapterOptions adapters_;
  std::unique_ptr<model::Answerer> teacher_, student_;
  distill::PairSide teacher_side_, student_side_;
  compress::NamedTensors base_trainable_;
  uint64_t fingerprint_ = 0;
  uint64_t vision_fingerprint_ = 0;
  SampleSpec spec_;
  size_t max_jobs_together_ = 1;

  // Train calls not yet taken into a group, oldest first.
  absl::Mutex queue_mu_;  // taken alone or inside mu_
  std::deque<TrainRequest*> waiting_ ABSL_GUARDED_BY(queue_mu_);

  absl::Mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<distill::PairDistiller>> distillers_
      ABSL_GUARDED_BY(mu_);
};

// The job settings the options stand for: distill_config (or the learner's preset) with the
// learner's feature term, and the option overrides of the job bounds.
absl::StatusOr<distill::DistillSettings> JobSettings(const PerDeviceStrategyOptions& options);

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_MIRROR_TRAINER_H_
